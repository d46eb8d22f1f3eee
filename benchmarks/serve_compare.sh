#!/usr/bin/env bash
# llama-server and dsinfer one after the other, same prompts, same run: both sides and ratios.
# Usage: benchmarks/serve_compare.sh [--llama-server PATH] [--dsinfer-config "ARGS"]... [--out DIR]
# (see benchmarks/serve_compare.py; builds llama-server once via ../shared/tools if needed)
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python benchmarks/serve_compare.py "$@"
