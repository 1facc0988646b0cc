#!/usr/bin/env bash
# The checks to run on a lent GPU machine (nothing reaches a registry there): the train loop's
# tests on CUDA, then the Kimi-K2.5-sized drafter's training step per draft vocabulary size.
# Needs pydantic's wheels in .whl/ (python3 -m pip download --no-deps --only-binary=:all:
# --python-version 3.12 ... -d .whl pydantic pydantic_core annotated-types typing-inspection).
# Run from the repository root: bash tools/gpu_check.sh; logs go to $OUT (or ./gpu-check/).
set -uo pipefail
out=${OUT:-gpu-check}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$out/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" 2>&1 | tee -a "$out/gpu.txt"
# Kimi-K2.5's language model as a plain DeepSeek-V3 config: an older transformers may not know
# the kimi_k25 wrapper; the drafter's shape comes from these fields alone
python3 - <<'PY'
import json, pathlib
text = json.load(open("tests/fixtures/kimi-k2.5/config.json"))["text_config"]
text["model_type"] = "deepseek_v3"
folder = pathlib.Path("/tmp/kimi-k2.5-text")
folder.mkdir(exist_ok=True)
(folder / "config.json").write_text(json.dumps(text))
PY
timeout 240 python3 bench/train.py --device cuda --target /tmp/kimi-k2.5-text --batch 1 --seq 2048 --ttt 7 \
    --dtype bfloat16 --steps 3 --draft-vocab 32768 --vocab-grid 16384 32768 65536 163840 2>&1 | tee "$out/bench-train-kimi.log"
CUBLAS_WORKSPACE_CONFIG=:4096:8 timeout 150 python3 -m pytest -q -p no:cacheprovider -rfEs tests/test_train.py tests/test_simulate.py 2>&1 | tee "$out/pytest-train.log"
# TTT cost at long samples (the merged flash form on CUDA; its test above ran first): the step at
# TTT 1 and 7 at 2K, 8K and 32K tokens, Kimi-K2.5's drafter at a 32K draft vocabulary, bf16
for seq in 2048 8192 32768; do
  timeout 150 python3 -m bench.ttt --device cuda --target /tmp/kimi-k2.5-text --draft-vocab 32768 --dtype bfloat16 \
      --batch 1 --seq $seq --ttt-grid 1 7 --rounds 2 --json "$out/ttt-$seq.json" 2>&1 | tee "$out/bench-ttt-$seq.log"
done
