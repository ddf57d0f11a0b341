"""StructuredOutputsParams: the request-side spec, checked once and kept as plain data."""

from __future__ import annotations

import pytest

from nvllm.common.sampling_params import SamplingParams
from nvllm.common.structured_outputs import StructuredOutputsParams as SO


def test_a_schema_dict_becomes_compact_text_in_its_own_key_order():
    so = SO(json={"type": "object", "properties": {"z": {}, "a": {}}})
    assert so.json == '{"type":"object","properties":{"z":{},"a":{}}}'
    assert so.kind == "json" and so.to_dict() == {"json": so.json}
    assert SO.from_any(so.to_dict()) == so  # what travels on the wire comes back equal


def test_keys_name_kind_text_and_compile_options():
    a, b = SO(regex="a+"), SO(regex="a+")
    assert a.key() == b.key() != SO(grammar="a+").key()
    assert a.key("compact") != a.key("any_ws")


@pytest.mark.parametrize("kw, words", [
    ({}, "set exactly one of"),
    ({"regex": "a", "choice": ["b"]}, "set exactly one of json, json_object, regex, grammar, "
                                      "choice (got 2)"),
    ({"regex": ""}, "structured_outputs.regex: must be a non-empty string"),
    ({"choice": []}, "structured_outputs.choice: must be a non-empty list"),
    ({"choice": ["a", 3]}, "structured_outputs.choice: must be a non-empty list"),
    ({"json": "{nope"}, "structured_outputs.json: is not valid JSON text"),
    ({"json": "[1]"}, "structured_outputs.json: must be a JSON schema"),
    ({"json_object": 1}, "structured_outputs.json_object: must be a bool"),
])
def test_bad_specs_name_the_field(kw, words):
    with pytest.raises(ValueError) as e:
        SO(**kw)
    assert words in str(e.value)


def test_a_schema_too_deep_to_serialise_says_so():
    deep: dict = {"type": "integer"}
    for _ in range(5000):
        deep = {"type": "array", "items": deep}
    with pytest.raises(ValueError, match="structured_outputs.json: is nested too deeply"):
        SO(json=deep)
    with pytest.raises(ValueError, match="is nested too deeply"):
        SO(json="[" * 100_000 + "]" * 100_000)


def test_sampling_params_take_a_map_and_refuse_ignore_eos_with_it():
    p = SamplingParams(structured_outputs={"choice": ["yes", "no"]})
    assert isinstance(p.structured_outputs, SO)
    assert p.to_dict()["structured_outputs"] == {"choice": ["yes", "no"]}
    assert SamplingParams.from_dict(p.to_dict()).structured_outputs == p.structured_outputs
    with pytest.raises(ValueError, match="unknown field.*'jsn'"):
        SamplingParams(structured_outputs={"jsn": {}})
    with pytest.raises(ValueError, match="ignore_eos cannot be combined"):
        SamplingParams(structured_outputs={"regex": "a"}, ignore_eos=True)
