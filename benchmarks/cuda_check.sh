#!/usr/bin/env bash
# The CUDA checks of the fast path as one prepared run for a lent GPU machine (the device tool;
# never CI): the gpu-marked tests (fused vs reference on the GPU, decode graphs replayed) and
# the 7B-shaped decode against the HBM roofline (benchmarks/cuda_decode.py). Needs .cuda/ from
# benchmarks/cuda_prepare.sh. Logs and the JSON go to $OUT (the device tool brings them back).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/cuda_check}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .cuda/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())" | tee -a "$out/gpu.txt"
# The gpu-marked files only: collecting the whole suite would import test dependencies the
# device's image lacks (openai, jsonschema, xgrammar, ...).
timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu $(grep -rl "pytest.mark.gpu" tests) \
    2>&1 | tee "$out/gpu_tests.log"
timeout 240 python3 benchmarks/cuda_decode.py --tokenizer .cuda/tokenizer \
    --json "$out/cuda_decode.json" 2>&1 | tee "$out/cuda_decode.log"
