"""The leader's grammar service (compile in a killable child, cache, limits) and its
record of what rank 0 holds."""

from __future__ import annotations

import json

import pytest

from nvllm.common.structured_outputs import StructuredOutputsParams as SO
from nvllm.leader.grammar import CompiledGrammar, GrammarError, GrammarService, WorkerGrammars
from nvllm.leader.grammar_compiler import choice_grammar, strict_json_strings


@pytest.fixture(scope="module")
def service(tiny):
    svc = GrammarService(tiny("qwen3"), 1024, [0], timeout_s=30.0, cache_bytes=1 << 20,
                         max_spec_bytes=4096, any_whitespace=False)
    yield svc
    svc.close()


def test_compiles_caches_and_shares_one_compile(service):
    so = SO(regex=r"[a-z]{3}\d")
    a, b = service.get(so), service.get(SO(regex=r"[a-z]{3}\d"))
    g = a.result(timeout=60)
    assert b.result(timeout=60) is g and isinstance(g, CompiledGrammar) and g.nbytes > 0
    compiled = service.num_compiled
    assert service.get(so).result() is g and service.num_compiled == compiled  # cached
    # For rank 0, with the first grammar: the model's vocabulary (1024, the config's), not
    # the tokenizer's 1000 entries, so masks cover every logit and ids past the
    # tokenizer's end are never allowed.
    info = json.loads(service.tokenizer_info)
    assert info["vocab_size"] == 1024 and info["stop_token_ids"] == [0]


def test_the_whitespace_policy_is_part_of_the_key(tiny):
    so = SO(json={"type": "object"})
    keys = {GrammarService(tiny("qwen3"), 1024, [0], timeout_s=1, cache_bytes=1,
                           max_spec_bytes=99, any_whitespace=ws).key(so) for ws in (False, True)}
    assert len(keys) == 2


@pytest.mark.parametrize("so, words", [
    (SO(regex="a(b"), "invalid structured_outputs.regex: Regex parsing error"),
    (SO(json={"type": "nope"}), 'invalid structured_outputs.json: Unsupported type "nope"'),
    (SO(grammar="root ::= undefined"), "invalid structured_outputs.grammar"),
    (SO(regex="a" * 5000), "structured_outputs.regex is 5000 bytes, more than "
                           "max_grammar_bytes 4096"),
])
def test_bad_specs_fail_naming_the_problem(service, so, words):
    with pytest.raises(GrammarError, match=None) as e:
        service.get(so).result(timeout=60)
    assert words in str(e.value)


def test_a_compile_past_the_time_limit_is_killed_and_the_next_one_works(tiny):
    svc = GrammarService(tiny("qwen3"), 1024, [0], timeout_s=30.0, cache_bytes=1 << 20,
                         max_spec_bytes=1 << 16, any_whitespace=False)
    try:
        svc.compile(SO(regex="warm"))  # the child is up: only the compile is timed now
        pid = svc.pid
        svc.timeout_s = 1e-4
        with pytest.raises(GrammarError, match="took longer than 0.0001 s to compile"):
            svc.compile(SO(json={"type": "object", "properties": {
                f"p{i}": {"type": "string", "maxLength": 50} for i in range(40)}}))
        assert svc.pid is None  # killed
        svc.timeout_s = 30.0
        assert svc.compile(SO(choice=["a", "b"])).nbytes > 0
        assert svc.pid not in (None, pid)
    finally:
        svc.close()
    assert svc.pid is None


def test_a_grammar_bigger_than_the_cache_is_refused(tiny):
    svc = GrammarService(tiny("qwen3"), 1024, [0], timeout_s=30.0, cache_bytes=2000,
                         max_spec_bytes=4096, any_whitespace=False)
    try:
        with pytest.raises(GrammarError, match="compiles to .* bytes, more than the grammar "
                                               r"cache \(2000 bytes"):
            svc.compile(SO(json={"type": "object", "properties": {"a": {"type": "string"}}}))
    finally:
        svc.close()


def test_choice_and_json_string_rules():
    assert choice_grammar(['a"b', "c\\d", "é"]) == r'root ::= "a\"b" | "c\\d" | "\u00e9"'
    loose = 'x ::= (([^\\"\\\\\\r\\n]))'
    assert strict_json_strings(loose) == 'x ::= (([^\\0-\\x1f\\"\\\\]))'


def test_worker_grammars_send_each_once_and_evict_only_unused():
    g = {k: CompiledGrammar(k, "x" * 40) for k in "abcd"}
    wg = WorkerGrammars(budget_bytes=100)
    live: set[str] = set()
    m = wg.load_for([g["a"], g["b"], g["a"]], "INFO", lambda: live)
    assert (m.tokenizer_info, m.keys, m.drop) == ("INFO", ["a", "b"], [])
    assert wg.load_for([g["a"]], "INFO", lambda: live) is None  # held already
    live = {"a"}
    m = wg.load_for([g["c"]], "INFO", lambda: live)  # 120 bytes > 100: b goes, a is live
    assert (m.tokenizer_info, m.keys, m.drop) == (None, ["c"], ["b"])
    wg.reset()  # a new worker group holds nothing
    m = wg.load_for([g["a"]], "INFO", lambda: live)
    assert (m.tokenizer_info, m.keys) == ("INFO", ["a"])
