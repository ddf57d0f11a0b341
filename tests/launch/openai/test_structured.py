"""nvllm.launch.openai.structured: every spelling of an output constraint (response_format,
structured_outputs, guided_*) reaches the leader as one structured_outputs map; more than
one, ignore_eos with one, and anything past the limits are 400s naming the field, before
any leader request. (And the OpenAI `user` reaches the leader as the routing key.)"""

from __future__ import annotations

import json

import pytest

from nvllm.common.sampling_params import SamplingParams
from nvllm.launch.openai import schemas

MESSAGES = [{"role": "user", "content": "hi"}]
ROUTES = [("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
          ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2})]
SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"enum": ["x"]}},
          "required": ["b"]}
SCHEMA_TEXT = json.dumps(SCHEMA, separators=(",", ":"))  # compact, keys in the given order


def error(r, status: int = 400) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


FORWARDED = [
    ({"response_format": {"type": "json_object"}}, {"json_object": True}),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "thing", "schema": SCHEMA, "strict": True, "description": "d"}}},
     {"json": SCHEMA_TEXT}),
    ({"structured_outputs": {"json": SCHEMA}}, {"json": SCHEMA_TEXT}),
    ({"structured_outputs": {"json": json.dumps(SCHEMA, indent=2)}}, {"json": SCHEMA_TEXT}),
    ({"structured_outputs": {"json_object": True}}, {"json_object": True}),
    ({"structured_outputs": {"regex": "[a-z]{3}"}}, {"regex": "[a-z]{3}"}),
    ({"structured_outputs": {"grammar": 'root ::= "yes" | "no"'}},
     {"grammar": 'root ::= "yes" | "no"'}),
    ({"structured_outputs": {"choice": ["yes", "no"], "json_object": False}},
     {"choice": ["yes", "no"]}),
    ({"guided_json": SCHEMA}, {"json": SCHEMA_TEXT}),
    ({"guided_regex": "\\d+"}, {"regex": "\\d+"}),
    ({"guided_choice": ["a", "b"]}, {"choice": ["a", "b"]}),
    ({"guided_grammar": 'root ::= "a"'}, {"grammar": 'root ::= "a"'}),
]


@pytest.mark.parametrize("fields,want", FORWARDED, ids=[str(i) for i in range(len(FORWARDED))])
def test_each_spelling_reaches_the_leader_as_one_map(gateway, leader, fields, want):
    c = gateway()
    for route, body in ROUTES:
        for stream in (False, True):
            r = c.post(route, json={**body, **fields, "stream": stream})
            assert r.status_code == 200, r.text
            params = leader.submits[-1]["params"]
            assert params["structured_outputs"] == want
            assert SamplingParams.from_dict(params).structured_outputs.to_dict() == want


def test_text_format_sets_nothing(gateway, leader):
    for route, body in ROUTES:
        assert gateway().post(route, json={**body, "response_format": {"type": "text"}}
                              ).status_code == 200
        assert "structured_outputs" not in leader.submits[-1]["params"]


BIG = schemas.MAX_CONSTRAINT_CHARS + 1
REFUSED = [
    # more than one source
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex",
     "response_format and guided_regex each constrain the output"),
    ({"structured_outputs": {"regex": "a"}, "guided_choice": ["a"]}, "guided_choice",
     "structured_outputs and guided_choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs",
     "exactly one of json, json_object, regex, grammar, choice (got regex, choice)"),
    ({"structured_outputs": {"json_object": False}}, "structured_outputs", "(got none)"),
    ({"structured_outputs": {}}, "structured_outputs", "(got none)"),
    ({"guided_json": SCHEMA, "ignore_eos": True}, "ignore_eos",
     "ignore_eos cannot be combined with guided_json"),
    # limits, each named
    ({"structured_outputs": {"regex": "a" * BIG}}, "structured_outputs.regex",
     f"at most {schemas.MAX_CONSTRAINT_CHARS} characters"),
    ({"guided_grammar": "a" * BIG}, "guided_grammar", "at most"),
    ({"structured_outputs": {"grammar": ""}}, "structured_outputs.grammar", "at least 1"),
    ({"guided_choice": ["a"] * (schemas.MAX_CHOICES + 1)}, "guided_choice",
     f"at most {schemas.MAX_CHOICES} items"),
    ({"structured_outputs": {"choice": ["a" * (schemas.MAX_CHOICE_CHARS + 1)]}},
     "structured_outputs.choice.0", f"at most {schemas.MAX_CHOICE_CHARS} characters"),
    ({"guided_choice": []}, "guided_choice", "at least 1"),
    ({"guided_choice": ["a" * schemas.MAX_CHOICE_CHARS] * schemas.MAX_CHOICES},
     "guided_choice", "characters together, more than the limit"),
    ({"guided_json": {"enum": ["x" * BIG]}}, "guided_json",
     f"more than the limit of {schemas.MAX_CONSTRAINT_CHARS}"),
    ({"structured_outputs": {"json": " " * BIG}}, "structured_outputs.json",
     "more than the limit"),
    # not a schema
    ({"structured_outputs": {"json": "[1, 2]"}}, "structured_outputs.json",
     "must be a JSON object"),
    ({"structured_outputs": {"json": "{nope"}}, "structured_outputs.json", "not valid JSON"),
    ({"structured_outputs": {"json": '{"a": NaN}'}}, "structured_outputs.json",
     "not valid JSON"),
    ({"guided_json": ["a"]}, "guided_json", "a JSON schema (an object or its JSON text)"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}},
     "response_format.json_schema.schema", "must be a JSON schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format",
     'json_schema goes with type "json_schema"'),
    ({"response_format": {"type": "json_object", "json_schema": {"name": "x", "schema": {}}}},
     "response_format", 'json_schema goes with type "json_schema"'),
    ({"response_format": {"type": "xml"}}, "response_format.type", "'json_schema'"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
     "response_format.json_schema.name", "Field required"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag",
     "Extra inputs"),
]


@pytest.mark.parametrize("fields,param,message", REFUSED, ids=[str(i) for i in range(len(REFUSED))])
def test_refused_constraints_name_the_field(gateway, leader, fields, param, message):
    c = gateway()
    for route, body in ROUTES:
        err = error(c.post(route, json={**body, **fields}))
        assert err["param"] == param, err
        assert message in err["message"], err
        assert err["type"] == "invalid_request_error"
    assert not leader.submits


def nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth - 1):
        schema = {"type": "array", "items": schema}
    return schema


def test_deep_schemas_are_refused_without_recursing(gateway, leader):
    """Past MAX_SCHEMA_DEPTH a schema is a 400 naming the limit; a 10k-deep one does not
    even parse as a body (json's own guard); neither reaches the leader."""
    c = gateway()
    for route, body in ROUTES:
        ok = c.post(route, json={**body, "guided_json": nested(schemas.MAX_SCHEMA_DEPTH)})
        assert ok.status_code == 200, ok.text
        for fields in ({"guided_json": nested(schemas.MAX_SCHEMA_DEPTH + 1)},
                       {"structured_outputs": {"json": json.dumps(nested(900))}}):
            err = error(c.post(route, json={**body, **fields}))
            assert f"more than {schemas.MAX_SCHEMA_DEPTH} levels" in err["message"], err
        # 10k deep: built as text (json.dumps would itself recurse too deeply)
        raw = (json.dumps({**body, "guided_json": "X"}).replace(
            '"X"', '{"items": ' * 10_000 + "{}" + "}" * 10_000)).encode()
        err = error(c.post(route, content=raw, headers={"content-type": "application/json"}))
        assert err["code"] == "invalid_json" and "nested too deeply" in err["message"]
    assert len(leader.submits) == 2


def test_leader_errors_about_the_constraint_are_400s(gateway, leader):
    """A constraint the leader cannot compile comes back as invalid_request: a 400."""
    leader.error = ("invalid_request", "SamplingParams.structured_outputs: regex: cannot "
                                       "compile '(': missing )")
    for route, body in ROUTES:
        err = error(gateway().post(route, json={**body, "guided_regex": "("}))
        assert err["type"] == "invalid_request_error"
        assert "cannot compile" in err["message"] and err["param"] == "guided_regex"


def test_the_openai_user_reaches_the_leader_as_its_routing_key(gateway, leader):
    """A data-parallel router keeps one user's requests on one replica (routing_key)."""
    for route, body in ROUTES:
        assert gateway().post(route, json={**body, "user": "alice"}).status_code == 200
        assert leader.submits[-1]["routing_key"] == "alice"
        assert gateway().post(route, json=body).status_code == 200
        assert leader.submits[-1]["routing_key"] is None
    r = gateway().post(ROUTES[0][0], json={**ROUTES[0][1], "user": "u" * 257})
    assert error(r)["param"] == "user"
