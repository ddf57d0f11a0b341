#!/usr/bin/env bash
# The main job: install, build the default tiny checkpoint, start the leader and two
# tensor-parallel CPU workers, generate for a few prompts, print text and throughput.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec nvllm-launch --model tiny:qwen3 --tp 2 --device cpu --dtype float32 --demo "$@"
