"""The engine's request rules (nvllm/common/request_checks.py): the same limits and the
same messages for a Python caller as for a client frame."""

from __future__ import annotations

import dataclasses
import math

import msgpack
import pytest

from nvllm.common import client_protocol as cp
from nvllm.common.client_decode import decode_client_frame
from nvllm.common.client_limits import default_limits
from nvllm.common.errors import RequestRejected
from nvllm.common.request_checks import (
    check_fits,
    check_params,
    check_prompt_ids,
    check_scheduling,
)
from nvllm.common.sampling_params import SamplingParams

LIMITS = dataclasses.replace(default_limits(), max_model_len=8, vocab_size=100,
                             max_num_seqs=4)


def test_an_over_long_prompt_gets_one_message_from_the_wire_and_the_engine():
    with pytest.raises(RequestRejected) as engine:
        check_prompt_ids([1] * 9, LIMITS)
    frame = msgpack.packb({"op": "submit", "id": "a", "prompt_token_ids": [1] * 9})
    with pytest.raises(cp.ClientProtocolError) as wire:
        decode_client_frame(frame, LIMITS)
    assert wire.value.code == "rejected"
    assert str(engine.value) == wire.value.message == "prompt has 9 tokens, max_model_len is 8"


@pytest.mark.parametrize("priority,ttl_ms,words", [
    (1.5, None, "priority must be an integer in int64"),
    (True, None, "priority must be an integer in int64"),
    (2**63, None, "priority must be an integer in int64"),
    (0, 0, "ttl_ms must be a positive number"),
    (0, math.nan, "ttl_ms must be a positive number"),
    (0, math.inf, "ttl_ms must be a positive number"),
    (0, "5", "ttl_ms must be a positive number"),
])
def test_scheduling_fields_use_the_wires_types(priority, ttl_ms, words):
    with pytest.raises(RequestRejected, match=words):
        check_scheduling(priority, ttl_ms)
    frame = msgpack.packb({"op": "submit", "id": "a", "prompt": "x", "priority": priority,
                           "ttl_ms": ttl_ms})
    with pytest.raises(cp.ClientProtocolError, match=words):
        decode_client_frame(frame, LIMITS)


def test_the_vocabulary_and_max_num_seqs():
    with pytest.raises(RequestRejected, match="token id 100 at position 1 is outside the "
                                              r"vocabulary \(valid ids are 0..99\)"):
        check_prompt_ids([5, 100], LIMITS)
    with pytest.raises(RequestRejected, match="prompt is empty"):
        check_prompt_ids([], LIMITS)
    with pytest.raises(RequestRejected, match=r"logit_bias holds 1 id\(s\) outside"):
        check_params(SamplingParams(logit_bias={100: 1.0}), LIMITS)
    with pytest.raises(RequestRejected, match="n=5 exceeds max_num_seqs 4"):
        check_params(SamplingParams(n=5), LIMITS)
    with pytest.raises(RequestRejected, match="lower max_tokens to 4 or less"):
        check_fits(4, 5, LIMITS)
    check_scheduling(-3, 2.5)
    check_fits(4, 4, LIMITS)
    assert check_prompt_ids((1, 99), LIMITS) == [1, 99]
