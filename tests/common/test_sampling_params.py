"""SamplingParams: defaults, validation messages, from_dict, stop ids."""

from __future__ import annotations

import math

import pytest

from nvllm.common.sampling_params import SamplingParams


def test_defaults():
    p = SamplingParams()
    assert p.n == 1
    assert p.temperature == 1.0 and not p.greedy
    assert p.top_p == 1.0 and p.top_k == 0 and p.min_p == 0.0
    assert p.seed is None
    assert p.max_tokens == 16 and p.min_tokens == 0
    assert p.stop_token_ids is None and p.ignore_eos is False
    assert p.repetition_penalty == 1.0
    assert p.presence_penalty == 0.0 and p.frequency_penalty == 0.0
    assert p.logprobs is None
    assert p.eos_token_ids == []
    assert SamplingParams(temperature=0).greedy


@pytest.mark.parametrize("kw", [
    dict(n=2), dict(temperature=0), dict(temperature=2.5), dict(top_p=1), dict(top_p=1e-6),
    dict(top_k=-1), dict(top_k=0), dict(top_k=1), dict(min_p=0), dict(min_p=1),
    dict(seed=0), dict(seed=2**63 - 1), dict(max_tokens=1), dict(min_tokens=16),
    dict(stop_token_ids=[]), dict(stop_token_ids=[0, 5]), dict(repetition_penalty=0.5),
    dict(presence_penalty=-2), dict(presence_penalty=2), dict(frequency_penalty=-2.0),
    dict(logprobs=0), dict(logprobs=20), dict(prompt_logprobs=0), dict(prompt_logprobs=20),
    dict(ignore_eos=True),
])
def test_valid_edges(kw):
    p = SamplingParams(**kw)
    for k, v in kw.items():
        assert getattr(p, k) == v


def test_stop_token_ids_tuple_becomes_list():
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]


@pytest.mark.parametrize("field,kw", [
    ("n", dict(n=0)),
    ("n", dict(n=-1)),
    ("n", dict(n=1.0)),
    ("n", dict(n=True)),
    ("temperature", dict(temperature=-1)),
    ("temperature", dict(temperature=math.nan)),
    ("temperature", dict(temperature=math.inf)),
    ("temperature", dict(temperature="1")),
    ("top_p", dict(top_p=0)),
    ("top_p", dict(top_p=1.5)),
    ("top_p", dict(top_p=math.nan)),
    ("top_k", dict(top_k=-2)),
    ("top_k", dict(top_k=2.0)),
    ("top_k", dict(top_k=True)),
    ("min_p", dict(min_p=2)),
    ("min_p", dict(min_p=-0.1)),
    ("seed", dict(seed=-1)),
    ("seed", dict(seed=2**63)),
    ("seed", dict(seed=1.0)),
    ("seed", dict(seed=False)),
    ("max_tokens", dict(max_tokens=0)),
    ("max_tokens", dict(max_tokens=True)),
    ("min_tokens", dict(min_tokens=-1)),
    ("min_tokens", dict(min_tokens=5, max_tokens=4)),
    ("min_tokens", dict(min_tokens=17)),  # > default max_tokens of 16
    ("stop_token_ids", dict(stop_token_ids=["a"])),
    ("stop_token_ids", dict(stop_token_ids=[1, -1])),
    ("stop_token_ids", dict(stop_token_ids=[1.0])),
    ("stop_token_ids", dict(stop_token_ids=[True])),
    ("stop_token_ids", dict(stop_token_ids=5)),
    ("ignore_eos", dict(ignore_eos=1)),
    ("repetition_penalty", dict(repetition_penalty=0)),
    ("repetition_penalty", dict(repetition_penalty=-1.0)),
    ("repetition_penalty", dict(repetition_penalty=math.inf)),
    ("presence_penalty", dict(presence_penalty=3)),
    ("presence_penalty", dict(presence_penalty=-2.5)),
    ("frequency_penalty", dict(frequency_penalty=2.01)),
    ("frequency_penalty", dict(frequency_penalty=math.nan)),
    ("logprobs", dict(logprobs=21)),
    ("logprobs", dict(logprobs=-1)),
    ("logprobs", dict(logprobs=True)),
    ("prompt_logprobs", dict(prompt_logprobs=21)),
    ("prompt_logprobs", dict(prompt_logprobs=-1)),
    ("prompt_logprobs", dict(prompt_logprobs=True)),
    ("logprobs", dict(logprobs=1.0)),
])
def test_invalid_value_names_the_field(field, kw):
    with pytest.raises(ValueError) as ei:
        SamplingParams(**kw)
    msg = str(ei.value)
    assert f"SamplingParams.{field}:" in msg, msg


def test_clone_validates():
    p = SamplingParams(max_tokens=8)
    assert p.clone(temperature=0.5).temperature == 0.5
    assert p.temperature == 1.0
    with pytest.raises(ValueError, match="top_p"):
        p.clone(top_p=0)


def test_from_dict_round_trip():
    p = SamplingParams(n=2, temperature=0.3, seed=7, stop_token_ids=[1], logprobs=3)
    assert SamplingParams.from_dict(p.to_dict()) == p
    assert SamplingParams.from_dict({"max_tokens": 5}).max_tokens == 5
    assert SamplingParams.from_dict({}) == SamplingParams()


def test_from_dict_rejects_unknown_keys():
    with pytest.raises(ValueError) as ei:
        SamplingParams.from_dict({"max_tokens": 5, "best_of": 2, "temprature": 0.1})
    msg = str(ei.value)
    assert "best_of" in msg and "temprature" in msg


def test_from_dict_validates_values():
    with pytest.raises(ValueError, match="SamplingParams.max_tokens"):
        SamplingParams.from_dict({"max_tokens": 0})


def test_all_stop_token_ids_honours_ignore_eos():
    p = SamplingParams(stop_token_ids=[5, 6]).clone(eos_token_ids=[2, 6])
    assert p.all_stop_token_ids() == {2, 5, 6}
    q = p.clone(ignore_eos=True)
    assert q.all_stop_token_ids() == {5, 6}
    assert SamplingParams().all_stop_token_ids() == set()
    assert SamplingParams().clone(eos_token_ids=[2]).all_stop_token_ids() == {2}
    assert SamplingParams(ignore_eos=True).clone(eos_token_ids=[2]).all_stop_token_ids() == set()


def test_logit_bias_takes_decimal_string_keys_as_json_sends_them():
    p = SamplingParams(logit_bias={"5": 10, 7: -100.0, "0": 0.5})
    assert p.logit_bias == {5: 10.0, 7: -100.0, 0: 0.5}
    assert all(type(k) is int and type(v) is float for k, v in p.logit_bias.items())
    assert SamplingParams().logit_bias is None and SamplingParams(logit_bias={}).logit_bias == {}
    assert SamplingParams.from_dict(p.to_dict()) == p and p.clone(n=2).logit_bias == p.logit_bias


SECRET_KEY = "tok-SECRET-9"


@pytest.mark.parametrize("bias,words", [
    ({"-1": 1}, "keys must be token ids"),
    ({-1: 1}, "keys must be token ids"),
    ({SECRET_KEY: 1}, "keys must be token ids"),
    ({"٣": 1}, "keys must be token ids"),  # a Unicode digit int() would take
    ({2**63: 1}, "keys must be token ids"),
    ({1.0: 1}, "keys must be token ids"),
    ({True: 1}, "keys must be token ids"),
    ({5: 100.5}, "[-100, 100]"),
    ({5: -101}, "[-100, 100]"),
    ({5: math.nan}, "[-100, 100]"),
    ({5: math.inf}, "[-100, 100]"),
    ({5: 10**400}, "[-100, 100]"),  # no OverflowError from a float conversion
    ({5: True}, "[-100, 100]"),
    ({5: "1"}, "[-100, 100]"),
    ({"5": 1, "05": 2}, "same token id"),
    ([[5, 1.0]], "must be a map"),
    ({i: 1.0 for i in range(65537)}, "more than 65536"),
])
def test_bad_logit_bias_is_named_and_never_echoed(bias, words):
    with pytest.raises(ValueError) as ei:
        SamplingParams(logit_bias=bias)
    msg = str(ei.value)
    assert msg.startswith("SamplingParams.logit_bias:") and words in msg, msg
    assert "SECRET" not in msg and len(msg) < 200


def test_logit_bias_of_65536_entries_is_accepted():
    assert len(SamplingParams(logit_bias={i: 1.0 for i in range(65536)}).logit_bias) == 65536
