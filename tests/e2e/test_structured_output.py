"""Structured output end to end (LLM and the ZMQ client) on a random-weight tiny model,
where only the constraint can make an output valid: JSON schemas, regexes and choices,
greedy and sampled, n > 1, tp 1 and 2, mixed with unconstrained requests (whose tokens
must not change), under preemption and prefix-cache hits, with stop strings, min_tokens
and max_tokens reached mid-structure."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from raw_client import RawClient
from served import serve, teardown, wait_idle

from nvllm import LLM, SamplingParams

pytestmark = pytest.mark.e2e

# Bounded (enum, maxLength, maxItems, compact whitespace): every output can finish.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "enum": [7, 42, 1999]},
        "tags": {"type": "array", "items": {"enum": ["a", "bc"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}
REGEX = r"[a-c]{2,4}-\d{2}"
CHOICES = ["yes", "no", "maybe so"]
PROMPTS = ["The capital of France is", "Once upon a time", "Q: 2+2? A:", "naïve café"]
SPECS = {"json": {"json": SCHEMA}, "regex": {"regex": REGEX}, "choice": {"choice": CHOICES}}


def check(kind: str, text: str) -> None:
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)  # json.loads is strict: no raw \x00-\x1f
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    else:
        assert text in CHOICES, text


def run(llm, specs: list[tuple[str, dict]], **kw):
    params = [SamplingParams(max_tokens=96, structured_outputs=so, **kw) for _, so in specs]
    outs = llm.generate(PROMPTS[:len(specs)], params, use_tqdm=False)
    assert all(o.error is None for o in outs), [o.error for o in outs]
    return outs


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def llm(request, tiny):
    with LLM(tiny("qwen3"), device="cpu", dtype="float32", block_size=8,
             tensor_parallel_size=request.param) as engine:
        yield engine


@pytest.mark.parametrize("sampling", [{"temperature": 0.0},
                                      {"temperature": 1.0, "seed": 5, "n": 2},
                                      {"temperature": 0.9, "top_p": 0.9}],
                         ids=["greedy", "seeded_n2", "top_p"])
def test_every_output_matches_its_constraint_and_free_requests_are_unchanged(llm, sampling):
    free = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    alone = llm.generate(PROMPTS, free, use_tqdm=False)
    kinds = ["json", "regex", "choice", "json"]
    params = [SamplingParams(max_tokens=96, structured_outputs=SPECS[k], **sampling)
              for k in kinds]
    outs = llm.generate(PROMPTS + PROMPTS, params + [free] * 4, use_tqdm=False)
    for kind, out in zip(kinds, outs[:4]):
        assert out.error is None
        for c in out.outputs:
            assert c.finish_reason == "stop", (kind, c.text)
            check(kind, c.text)
    assert [o.token_ids for o in outs[4:]] == [o.token_ids for o in alone]


def test_seeded_constrained_output_is_reproducible(llm):
    a = run(llm, [("json", SPECS["json"])], temperature=1.0, seed=9)
    b = run(llm, [("json", SPECS["json"])] * 3, temperature=1.0, seed=9)
    assert a[0].token_ids == b[0].token_ids


def test_max_tokens_mid_structure_finishes_with_length(llm):
    out = llm.generate(PROMPTS[:1], SamplingParams(
        max_tokens=5, temperature=0.0, structured_outputs=SPECS["json"]), use_tqdm=False)
    c = out[0].outputs[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 5
    assert c.text.startswith('{"name')
    with pytest.raises(json.JSONDecodeError):
        json.loads(c.text)


def test_min_tokens_yields_when_the_grammar_allows_only_eos(llm):
    # "yes" is complete after a token or two; min_tokens=10 cannot be met inside the
    # grammar, so the stop token is sampled (never a row of -inf logits) and ends it.
    out = llm.generate(PROMPTS[:1], SamplingParams(
        max_tokens=20, min_tokens=10, temperature=0.0, structured_outputs={"choice": ["yes"]}),
        use_tqdm=False)
    c = out[0].outputs[0]
    assert (c.text, c.finish_reason) == ("yes", "stop")
    assert len(c.token_ids) < 10


def test_stop_strings_cut_a_constrained_output(llm):
    out = llm.generate(PROMPTS[:1], SamplingParams(
        max_tokens=96, temperature=0.0, structured_outputs=SPECS["json"], stop=['"age"']),
        use_tqdm=False)
    c = out[0].outputs[0]
    assert c.finish_reason == "stop" and c.text.startswith('{"name":"')
    assert '"age"' not in c.text and c.text.endswith(",")


def test_invalid_specs_are_refused_naming_the_problem(llm):
    bad = [{"regex": "a(b"}, {"json": {"type": "bogus"}}, {"grammar": "root ::= x"}]
    outs = llm.generate(["x"] * 3, [SamplingParams(structured_outputs=so) for so in bad],
                        use_tqdm=False)
    assert "invalid structured_outputs.regex" in outs[0].error and "parenthesis" in outs[0].error
    assert "invalid structured_outputs.json" in outs[1].error and "bogus" in outs[1].error
    assert "invalid structured_outputs.grammar" in outs[2].error and '"x"' in outs[2].error
    with pytest.raises(ValueError, match="ignore_eos cannot be combined"):
        SamplingParams(ignore_eos=True, structured_outputs={"regex": "a"})


def test_an_ebnf_grammar_and_any_json_object(llm):
    grammar = 'root ::= "(" digit ("+" digit)* ")"\ndigit ::= [0-9]'
    outs = llm.generate(PROMPTS[:2], [
        SamplingParams(max_tokens=40, temperature=0.0, structured_outputs={"grammar": grammar}),
        SamplingParams(max_tokens=200, temperature=0.0,
                       structured_outputs={"json_object": True})], use_tqdm=False)
    assert re.fullmatch(r"\(\d(\+\d)*\)", outs[0].text) and outs[0].finish_reason == "stop"
    if outs[1].finish_reason == "stop":  # free-form JSON may run to max_tokens
        assert isinstance(json.loads(outs[1].text), dict)
    assert outs[1].text.startswith("{") and " " not in outs[1].text.replace('" "', "")


STRESS = dict(enable_prefix_caching=True, max_num_batched_tokens=32, num_kv_blocks=24,
              block_size=8)


def test_exact_under_preemption_and_prefix_hits(tiny):
    """Greedy constrained outputs with preemption (replayed matchers) and a second batch
    from the prefix cache equal those of a roomy engine."""
    prefix = "A long shared system prompt that spans several blocks of eight tokens. "
    prompts = [prefix + p for p in PROMPTS] * 2
    kinds = ["json", "regex", "choice", "json"] * 2
    params = [SamplingParams(max_tokens=64, temperature=0.0, structured_outputs=SPECS[k])
              for k in kinds]
    with LLM(tiny("qwen3"), device="cpu", dtype="float32", block_size=8) as roomy:
        want = [o.token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    with LLM(tiny("qwen3"), device="cpu", dtype="float32", **STRESS) as small:
        first = small.generate(prompts, params, use_tqdm=False)
        second = small.generate(prompts, params, use_tqdm=False)
        assert small.engine.scheduler.num_preemptions > 0
        assert small.engine.kv.stats.hits > 0
    for outs in (first, second):
        assert [o.token_ids for o in outs] == want
        for kind, o in zip(kinds, outs):
            check(kind, o.text)


@pytest.fixture(scope="module")
def served(tiny):
    s = serve(LLM(tiny("qwen3"), device="cpu", dtype="float32"))
    yield s
    teardown(s)


def test_zmq_client_constrained_requests_and_errors(served):
    from nvllm import Client

    with Client(served.endpoint, timeout_s=120) as c:
        out = c.generate("Hello", SamplingParams(max_tokens=96, temperature=0.0,
                                                 structured_outputs=SPECS["json"]))
        check("json", out.text)
        # A params map as a non-Python client sends it: the schema as JSON text.
        out = c.generate("Hello", {"max_tokens": 32, "temperature": 0.0,
                                   "structured_outputs": {"choice": CHOICES}})
        check("choice", out.text)
    with RawClient(served.endpoint, timeout_s=60) as raw:
        raw.send_map({"op": "submit", "v": 1, "id": "bad", "prompt": "x",
                      "params": {"structured_outputs": {"regex": "a(b"}}})
        err = raw.wait_map("bad")
        assert err["op"] == "error" and err["code"] == "invalid_request"
        assert "invalid structured_outputs.regex" in err["message"]
        raw.send_map({"op": "submit", "v": 1, "id": "big", "prompt": "x",
                      "params": {"structured_outputs": {"regex": "a" * 70000}}})
        err = raw.wait_map("big")
        assert err["code"] == "invalid_request" and "max_grammar_bytes" in err["message"]
    wait_idle(served.llm)


def test_32_concurrent_requests_mixed_with_free_ones(served):
    """16 constrained (every kind, greedy and sampled, streamed and whole) and 16 free
    requests at once over one AsyncClient: every constrained output validates, every
    free one has exactly the tokens it has alone."""
    import asyncio

    from nvllm import AsyncClient

    free = {"max_tokens": 16, "temperature": 0.0, "ignore_eos": True}
    prompts = [f"{PROMPTS[i % 4]} #{i}" for i in range(16)]
    kinds = [("json", "regex", "choice")[i % 3] for i in range(16)]

    async def free_alone():
        c = AsyncClient(served.endpoint, timeout_s=120)
        try:
            return await asyncio.gather(*[c.generate(q, free) for q in prompts])
        finally:
            c.close()

    alone = [o.token_ids for o in asyncio.run(free_alone())]

    async def main():
        c = AsyncClient(served.endpoint, timeout_s=120)
        try:
            async def constrained(i):
                p = {"max_tokens": 96, "structured_outputs": SPECS[kinds[i]]} | (
                    {"temperature": 0.0} if i % 2 else {"temperature": 1.0, "seed": i})
                if i % 4 < 2:
                    return (await c.generate(prompts[i], p)).text
                return "".join([d.text async for d in c.stream(prompts[i], p)])

            return await asyncio.gather(*[constrained(i) for i in range(16)],
                                        *[c.generate(q, free) for q in prompts])
        finally:
            c.close()

    outs = asyncio.run(main())
    for kind, text in zip(kinds, outs[:16]):
        check(kind, text)
    assert [o.token_ids for o in outs[16:]] == alone
    wait_idle(served.llm)
