#!/usr/bin/env bash
# nvllm's OpenAI gateway vs `vllm serve`, measured with vLLM's own `vllm bench serve`
# client (both dtypes, interleaved rounds; the peer's venv is made on first use):
#
#   bash scripts/serve_vs_vllm.sh [--rounds 3] [--dtypes float32 bfloat16] [--model DIR]
#
# Prints one line of ratios at the end; scripts/serve_vs_vllm.py has the details.
set -euo pipefail
cd "$(dirname "$0")/.."
exec python scripts/serve_vs_vllm.py "$@"
