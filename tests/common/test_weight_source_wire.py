"""The wire of weight updates from other sources: the client messages' bounds (each
refusal names the field and its limit), CUDA IPC refs (what a worker accepts before it
opens anything), and the engine-side checks of the same arguments."""

from __future__ import annotations

import numpy as np
import pytest

from nvllm.common import client_protocol as cp
from nvllm.common.client_decode import decode_client_frame
from nvllm.common.client_limits import weight_group_error
from nvllm.common.cuda_ipc import IpcRef, is_ipc_ref
from nvllm.common.transport import inline_ref
from nvllm.common.weight_transfer import WeightUpdateError


def _group(**kw) -> cp.InitWeightUpdateGroup:
    args = dict(master_address="10.0.0.5", master_port=29600, rank_offset=1, world_size=3)
    return cp.InitWeightUpdateGroup(**{**args, **kw})


@pytest.mark.parametrize("msg,match", [
    (_group(master_address=""), "master_address must have at least 1 character"),
    (_group(master_address="h" * 256), "master_address.*more than 255"),
    (_group(master_port=0), "master_port must be >= 1"),
    (_group(master_port=65536), "master_port must be <= 65535"),
    (_group(world_size=1), "world_size must be >= 2"),
    (_group(world_size=4097), "world_size must be <= 4096"),
    (_group(rank_offset=0), "rank_offset must be >= 1"),
    (_group(rank_offset=3), "rank_offset must be below world_size"),
    (_group(group_name="g" * 129), "group_name.*more than 128"),
    (_group(backend="mpi"), "backend"),
    (_group(timeout_s=601.0), "timeout_s must be <= 600"),
    (cp.UpdateWeightsFromPath(path="p" * 4097), "path.*more than 4096"),
    (cp.WeightsFromDistributed(chunk=0, names=["a"], dtypes=["int8"], shapes=[[1]]),
     "dtypes"),
    (cp.WeightsFromDistributed(chunk=0, names=["a"], dtypes=["float32"], shapes=[[1] * 9]),
     r"shapes\[0\].*more than 8"),
    (cp.WeightsFromDistributed(chunk=0, names=["a", "b"], dtypes=["float32"],
                               shapes=[[1], [2]]), "one entry each per tensor"),
    (cp.WeightsChunk(chunk=0, names=["a", "b"], dtypes=["float32"] * 2,
                     refs=[inline_ref(np.zeros(1, np.float32)).encode()] * 2, rows=[0, 4]),
     "one tensor's rows"),
    (cp.WeightsChunk(chunk=0, names=["a"], dtypes=["float32"],
                     refs=[["cuda_ipc", b"x" * 63, 0, 0, [2], [1]]]), "64 bytes"),
])
def test_refusals_name_the_field_and_limit(msg, match):
    with pytest.raises(cp.ClientProtocolError, match=match) as e:
        decode_client_frame(cp.encode(msg))
    assert e.value.code == "invalid_request"


def test_good_messages_decode_to_themselves():
    for msg in (_group(), _group(backend="nccl", group_name="g", timeout_s=5.0),
                cp.UpdateWeightsFromPath(path="/ckpt/step-3", weight_version=3),
                cp.WeightsFromDistributed(chunk=1, names=["a"], dtypes=["bfloat16"],
                                          shapes=[[4, 8]]),
                cp.WeightsChunk(chunk=0, names=["a"], dtypes=["float16"],
                                refs=[IpcRef(b"h" * 64, 1, 512, (4, 8), (1, 4)).encode()])):
        assert decode_client_frame(cp.encode(msg)) == msg


def test_ipc_refs_round_trip_and_refuse_malformed_ones():
    ref = IpcRef(b"\0" * 64, 3, 4096, (16, 8), (1, 16))
    assert is_ipc_ref(ref.encode()) and IpcRef.decode(ref.encode()) == ref
    assert ref.extent(2) == 2 * (1 + 15 * 1 + 7 * 16)
    assert IpcRef(b"\0" * 64, 0, 0, (0, 8), (8, 1)).extent(4) == 0
    assert not is_ipc_ref([1, "float32", [4], "seg", 0, 0])  # an ArrayRef
    for bad, match in [(["cuda_ipc", b"\0" * 64, 0, 0, [2]], r"\[.cuda_ipc., handle"),
                       (["cuda_ipc", b"\0" * 64, -1, 0, [2], [1]], "device"),
                       (["cuda_ipc", b"\0" * 64, 0, -8, [2], [1]], "offset"),
                       (["cuda_ipc", b"\0" * 64, 0, 0, [2, 2], [1]], "one stride per"),
                       (["cuda_ipc", b"\0" * 64, 0, 0, [1] * 9, [1] * 9], "at most 8"),
                       (["cuda_ipc", "text" * 16, 0, 0, [2], [1]], "64 bytes")]:
        with pytest.raises(WeightUpdateError, match=match):
            IpcRef.decode(bad)


def test_the_engine_checks_the_same_group_arguments():
    ok = ("10.0.0.5", 29600, 1, 3, "weight_update_group", None, 60.0)
    assert weight_group_error(*ok, tp=2) is None
    assert "exceeds world_size" in weight_group_error(*ok, tp=3)
    assert "master_port" in weight_group_error("h", True, 1, 3, "g", None, 60.0)
    assert "timeout_s" in weight_group_error("h", 1, 1, 3, "g", None, float("nan"))
    assert "backend" in weight_group_error("h", 1, 1, 3, "g", "mpi", 60.0)
