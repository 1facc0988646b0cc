"""A do-nothing replacement for SGLang's compiled kernel package, for running SGLang on a CPU.

Why it exists: SGLang's CPU path (SGLANG_USE_CPU_ENGINE=1) still imports `sgl_kernel`, and
names in it, while its modules load (for instance `sglang.srt.layers.quantization.utils` reads
`scalar_types.uint4b8` at import time). PyPI has no CPU build of that package: the
`sglang-kernel` wheel that `pip install sglang` pulls in is the GPU one. Without speculative
decoding (`--attention-backend torch_native`) none of its kernels is called; the speculative
paths (EAGLE-3, NGRAM, `--attention-backend intel_amx` through tools/sglang_cpu/launch_server.py)
call the few that spec_kernels.py implements in pure torch.

How it behaves: put the folder holding this package first on PYTHONPATH (and uninstall
`sglang-kernel`). Then any name looked up on `sgl_kernel`, or on any `sgl_kernel.<sub>.<module>`,
gives the real kernel of that name when spec_kernels.py has one (SGLang imports the same
kernel from different submodules), else a placeholder. Calling a placeholder raises
NotImplementedError naming it, so a kernel that is in fact needed fails loudly, never
silently. Names looked up on a placeholder give placeholders too, so module-level constants
such as `scalar_types.uint4b8` resolve.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types


def _is_dunder(name: str) -> bool:
    # Leave protocol lookups (__wrapped__, __signature__, ...) alone: answering them with a
    # placeholder would confuse inspect, pickle and friends.
    return name.startswith("__") and name.endswith("__")


class Placeholder:
    """Stands for a kernel (or any object) of sgl_kernel that this machine does not have."""

    def __init__(self, dotted: str) -> None:
        self.__qualname__ = dotted
        self.__name__ = dotted.rpartition(".")[2]

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(
            f"{self.__qualname__} belongs to the compiled sgl_kernel package, which this CPU stand-in "
            "(tools/sglang_cpu/sgl_kernel) does not provide"
        )

    def __getattr__(self, name: str) -> Placeholder:
        if _is_dunder(name):
            raise AttributeError(name)
        return Placeholder(f"{self.__qualname__}.{name}")

    def __repr__(self) -> str:
        return f"<sgl_kernel placeholder {self.__qualname__}>"


def _lookup_for(module_name: str):
    """A module-level __getattr__ (PEP 562) that hands out real kernels, else placeholders."""

    def __getattr__(name: str):
        if _is_dunder(name):
            raise AttributeError(name)
        if name in KERNELS:
            return KERNELS[name]
        return Placeholder(f"{module_name}.{name}")

    return __getattr__


_REAL_MODULES = {__name__ + ".spec_kernels"}


class _Submodules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Makes every `import sgl_kernel.<anything>` succeed with an empty placeholder module."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname in _REAL_MODULES:
            return None  # a file of this folder: the normal finder loads it
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []  # a package, so that deeper submodules resolve as well
        module.__getattr__ = _lookup_for(spec.name)
        return module

    def exec_module(self, module) -> None:
        pass


if not any(isinstance(finder, _Submodules) for finder in sys.meta_path):
    sys.meta_path.insert(0, _Submodules())

__getattr__ = _lookup_for(__name__)

from .spec_kernels import KERNELS, install_torch_ops  # noqa: E402 - after the finder is in place

install_torch_ops()
