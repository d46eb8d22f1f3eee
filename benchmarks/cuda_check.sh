#!/usr/bin/env bash
# The CUDA checks of the fast path as one prepared run for a lent GPU machine (the device tool;
# never CI): the gpu-marked tests (fused vs reference on the GPU, decode graphs replayed, routed
# experts in graphs, int4 weights through torch's tensor-core kernel), benchmarks/graph_probe.py
# (where a replay parts from eager, if it does) and two decodes against the HBM roofline
# (benchmarks/cuda_decode.py): the 7B (Llama shape; also on int4 weights) and DeepSeek-V2-Lite
# (MLA, DeepSeekMoE), fused vs reference, then
# `dsinfer serve` on CUDA under `dsinfer bench serve`, then benchmarks/cuda_variants.py
# (candidate changes to the fused step, timed). Needs .cuda/
# from benchmarks/cuda_prepare.sh. Each part has its own time limit, so that one hung part
# leaves the others' results; logs, JSON and the fused decodes' kernel tables go to $OUT (7
# files: the device tool brings back 8 at most).
#   run(command="bash benchmarks/cuda_check.sh", carry=[".cuda"], timeout_s=540)
# (the first run, without the profiles and variants, took 72 s of the machine's time.)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/cuda_check}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .cuda/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
# Real weights for the GGUF path's gpu test: SmolLM2's first 8 layers (cuda_prepare.sh).
[ -f .cuda/smollm2-8-layers.gguf ] && export DSINFER_GPU_SMOLLM2=$PWD/.cuda/smollm2-8-layers.gguf
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c "import torch, transformers; print('torch', torch.__version__, torch.cuda.get_device_name(), torch.cuda.get_device_capability(), 'transformers', transformers.__version__, 'F.grouped_mm', hasattr(torch.nn.functional, 'grouped_mm'))"
} 2>&1 | tee "$out/checks.log"
# The gpu-marked files only: collecting the whole suite would import test dependencies the
# device's image lacks (openai, jsonschema, xgrammar, ...).
timeout 200 python3 -m pytest -q -p no:cacheprovider -rfEs --tb=short -m gpu \
    $(grep -rl "pytest.mark.gpu" tests) 2>&1 | tee -a "$out/checks.log"
echo "gpu tests: exit ${PIPESTATUS[0]}" | tee -a "$out/checks.log"
# Replayed graphs against the eager step, module by module where they part (tiny models).
for probe in "" "--tiny-v2 --dtype bfloat16"; do
    timeout 60 python3 benchmarks/graph_probe.py --hooks $probe 2>&1 | grep -v "Writing model" \
        | tail -12 | tee -a "$out/checks.log"
done
timeout 160 python3 benchmarks/cuda_decode.py --tokenizer .cuda/tokenizer --int4 \
    --json "$out/cuda_decode_7b.json" --profile "$out" 2>&1 | tee "$out/cuda_decode_7b.log"
echo "7B decode: exit ${PIPESTATUS[0]}" | tee -a "$out/checks.log"
timeout 120 python3 benchmarks/cuda_decode.py --config deepseek-v2-lite \
    --tokenizer .cuda/tokenizer --kv-cache-memory 2GiB \
    --json "$out/cuda_decode_v2_lite.json" --profile "$out" 2>&1 \
    | tee "$out/cuda_decode_v2_lite.log"
echo "V2-Lite decode: exit ${PIPESTATUS[0]}" | tee -a "$out/checks.log"
# Served on CUDA: the OpenAI-compatible server on the 7B shape (random weights), and dsinfer's
# own load generator at 1 and 16 streams (128 tokens in, 64 out).
python3 -m dsinfer.cli serve benchmarks/configs/deepseek-llm-7b-base --random-weights \
    --device cuda --tokenizer .cuda/tokenizer --port 8011 > /tmp/serve.log 2>&1 &
server=$!
python3 - <<'PY'
import time, urllib.request
for _ in range(120):
    try:
        urllib.request.urlopen("http://127.0.0.1:8011/health", timeout=1)
        break
    except OSError:
        time.sleep(1)
PY
for c in 1 16; do
    timeout 90 python3 -m dsinfer.cli bench serve --url http://127.0.0.1:8011 --concurrency $c \
        --num-requests $((4 * c)) --input-len 128 --output-len 64 2>&1 | grep -v " INFO " \
        | tee -a "$out/checks.log"
done
kill $server
for _ in $(seq 1 15); do kill -0 $server 2>/dev/null || break; sleep 1; done
kill -9 $server 2>/dev/null  # a server that would not stop must not hold the run
echo "server log, last lines:" >> "$out/checks.log"; tail -15 /tmp/serve.log >> "$out/checks.log"
# Candidate changes to the fused step, timed one after another (7B shape): last, so that the
# checks above have run whatever this costs.
(cd benchmarks && timeout 200 python3 cuda_variants.py --tokenizer ../.cuda/tokenizer) 2>&1 \
    | grep -v "torch/_dynamo" | tee -a "$out/checks.log"
grep -E "^(torch|gpu tests|7B|V2-Lite|batch|  batch|NVIDIA|worst|fused|reference|url|throughput|TTFT|ITL)" "$out"/*.log
