#!/bin/bash
# Data-parallel replicas over nodes under torchrun: run this once on every node (one
# torchrun process per node, not per GPU); each node starts its replicas, NODE_RANK=0
# also the router, which prints the client endpoint. Replica r runs on node
# r * TP // DEVICES_PER_NODE; the other nodes register theirs on MASTER_ADDR:MASTER_PORT+1.
#
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 MASTER_PORT=29500 NVLLM_DEVICES_PER_NODE=8 \
#       scripts/torchrun_dp.sh --model /ckpt --tp 4 --data-parallel-size 4 \
#       --curve-key-dir /shared/keys                                           # on node0
#   NNODES=2 NODE_RANK=1 ... (the same)                                         # on node1
#
# Every argument goes to nvllm-launch (docs/data-parallel.md, "On several nodes").
set -euo pipefail
PYTHON=${NVLLM_PYTHON:-python}
if [ -z "${MASTER_PORT:-}" ]; then
    if [ "${NNODES:-1}" != 1 ]; then echo "set MASTER_PORT (a free port on node 0)" >&2; exit 2; fi
    MASTER_PORT=$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0))
print(s.getsockname()[1])')
fi
exec "$PYTHON" -m torch.distributed.run --nnodes "${NNODES:-1}" --node-rank "${NODE_RANK:-0}" \
    --nproc-per-node 1 --master-addr "${MASTER_ADDR:-127.0.0.1}" \
    --master-port "$MASTER_PORT" -m nvllm.launch.dp_nodes "$@"
