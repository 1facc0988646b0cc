"""`python -m sglang.launch_server` for a CPU without AMX that keeps `--attention-backend intel_amx`.

SGLang 0.5.23 rewrites intel_amx to torch_native when the platform reports no AMX
(sglang/srt/arg_groups/overrides.py, _attention_backend_platform_fallbacks), and torch_native
cannot serve speculative decoding (no EAGLE draft backend, no tree mask in TARGET_VERIFY). The
intel_amx backend itself only calls three sgl_kernel ops (decode and extend attention, draft
decode metadata), which ./sgl_kernel implements in plain torch; no AMX instruction runs. So
this launcher sets the one platform fact SGLang reads for that fallback, has_amx, and nothing
else: AMX weight packing asks utils.common.cpu_has_amx_support() and stays off.

With `--speculative-algorithm DFLASH` it also installs ./dflash_cpu.py, in this process and in
the scheduler processes: SGLang starts those with multiprocessing's spawn, which re-runs this
file's module level (as `__mp_main__`) in each child, so the module level below is the part
every process runs and the server itself starts only under `__main__`.

Run it with the SGLang venv's python, SGLANG_USE_CPU_ENGINE=1 and this folder first on
PYTHONPATH; every argument goes to sglang.launch_server. On a GPU, or a CPU with AMX and the
real sgl_kernel, use `python -m sglang.launch_server` itself.
"""

import runpy
import sys

from sglang.srt.runtime_context import _PLATFORM

_PLATFORM._install(has_amx=True)

if "DFLASH" in sys.argv:  # children get the parent's argv from spawn
    import dflash_cpu

    dflash_cpu.install()

if __name__ == "__main__":
    sys.argv[0] = "sglang.launch_server"
    # alter_sys=False keeps this file as sys.modules["__main__"], which is what makes spawn
    # re-run it in the children
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=False)
