#!/bin/bash
# nvllm under torchrun: run this on every node; the node with NODE_RANK=0 also runs the
# leader (beside global rank 0), which prints the client endpoint.
#
#   NPROC_PER_NODE=2 scripts/torchrun.sh --model tiny:qwen3 --prompt "Hello"
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 MASTER_PORT=29500 NPROC_PER_NODE=4 \
#       scripts/torchrun.sh --model /ckpt --curve-key-dir /shared/keys     # on node0
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=node0 MASTER_PORT=29500 NPROC_PER_NODE=4 \
#       scripts/torchrun.sh --model /ckpt --curve-key-dir /shared/keys     # on node1
#
# Every argument goes to the leader (nvllm-launch options; --tp is the world size).
set -euo pipefail
PYTHON=${NVLLM_PYTHON:-python}
if [ -z "${MASTER_PORT:-}" ]; then
    if [ "${NNODES:-1}" != 1 ]; then echo "set MASTER_PORT (a free port on node 0)" >&2; exit 2; fi
    MASTER_PORT=$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0))
print(s.getsockname()[1])')
fi
exec "$PYTHON" -m torch.distributed.run --nnodes "${NNODES:-1}" --node-rank "${NODE_RANK:-0}" \
    --nproc-per-node "${NPROC_PER_NODE:-1}" --master-addr "${MASTER_ADDR:-127.0.0.1}" \
    --master-port "$MASTER_PORT" -m nvllm.launch.worker "$@"
