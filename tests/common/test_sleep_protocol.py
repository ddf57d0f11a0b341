"""sleep, wake_up and state on the client wire: they round-trip, every field is bounded
(a level, a pause mode, known wake tags, each list capped) and refused by name; the
answers carry a SleepReport whole."""

from __future__ import annotations

import msgpack
import pytest

from nvllm.common import client_protocol as cp
from nvllm.common.client_decode import decode_client_frame
from nvllm.common.sleep_mode import SleepReport, check_level, check_tags


def test_sleep_messages_round_trip():
    for msg in (cp.Sleep(level=2, mode="keep"), cp.Sleep(), cp.WakeUp(),
                cp.WakeUp(tags=["weights", "kv_cache"]), cp.StateRequest()):
        assert decode_client_frame(cp.encode(msg)) == msg
    report = SleepReport(2, ["weights"], 10, 20, 30, 40, 5)
    for answer in (cp.Slept, cp.WokeUp):
        assert cp.decode_server_frame(cp.encode(answer.of(report))).to_report() == report
    state = cp.EngineState(True, True, 1, ["kv_cache"], 0, "v7")
    assert cp.decode_server_frame(cp.encode(state)) == state


@pytest.mark.parametrize("frame,field", [
    ({"op": "sleep", "level": 3}, "level"),
    ({"op": "sleep", "level": True}, "level"),
    ({"op": "sleep", "mode": "nap"}, "mode"),
    ({"op": "wake_up", "tags": ["weights", "x"]}, "tags[1]"),
    ({"op": "wake_up", "tags": ["weights"] * 4}, "tags"),
    ({"op": "wake_up", "tags": []}, "tags"),
    ({"op": "wake_up", "tags": "weights"}, "tags"),
    ({"op": "state", "v": 2}, None),
])
def test_sleep_fields_are_bounded(frame, field):
    with pytest.raises(cp.ClientProtocolError) as e:
        decode_client_frame(msgpack.packb(frame))
    if field is not None:
        assert e.value.code == "invalid_request" and e.value.message.startswith(field)


def test_levels_and_tags():
    assert check_level(2) == 2 and check_tags(None) == ["weights", "kv_cache", "scheduling"]
    assert check_tags(["scheduling", "weights"]) == ["weights", "scheduling"]
    for bad in (0, 3, True):
        with pytest.raises(ValueError, match="sleep level must be 1"):
            check_level(bad)
    with pytest.raises(ValueError, match="wake_up tags"):
        check_tags(["everything"])
