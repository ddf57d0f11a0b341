"""Rank 0's structured output: grammars loaded from the leader's message, matchers started
(with replay), and masks in every sampling path (batched greedy argmax, per-row sampling,
min_tokens against a grammar that allows only EOS), logprobs taken before the mask."""

from __future__ import annotations

import pytest
import torch

from nvllm.common.worker_protocol import LoadGrammars, WorkerSampling
from nvllm.worker.sampler import Sampler, SampleRequest
from nvllm.worker.structured_output import StructuredOutputState

xgr = pytest.importorskip("xgrammar")
VOCAB = 1024
EOS = 0


@pytest.fixture(scope="module")
def tok(tiny):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny("qwen3"))


@pytest.fixture(scope="module")
def state(tok):
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=VOCAB, stop_token_ids=[EOS])
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    grammars = {"yes": compiler.compile_grammar('root ::= "yes"'),
                "digits": compiler.compile_regex(r"[0-9]{2,3}")}
    st = StructuredOutputState()
    st.load(LoadGrammars(info.serialize_json(), list(grammars),
                         [g.serialize_json() for g in grammars.values()], []))
    return st


def sampling(key, **kw):
    return WorkerSampling(grammar_key=key, stop_token_ids=[EOS], **kw)


def test_greedy_batched_argmax_masks_only_constrained_rows(state, tok):
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    raw = logits.clone()
    state.start(1, sampling("digits"), [])
    state.start(2, sampling("yes"), [])
    reqs = [SampleRequest(sampling("digits"), [5], 1, state.matcher(1)),
            SampleRequest(WorkerSampling(), [5], 1),
            SampleRequest(sampling("yes"), [5], 1, state.matcher(2))]
    tokens, _ = Sampler(0)(logits, reqs)
    assert tok.decode([tokens[0]]).isdigit()
    assert "yes".startswith(tok.decode([tokens[2]]))
    assert tokens[1] == int(raw[1].argmax())  # the free row is untouched


def test_sampled_rows_are_masked_and_logprobs_are_the_models(state, tok):
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(1))
    raw_lp = torch.log_softmax(logits, -1)
    for sid in (3, 4):
        state.start(sid, sampling("digits"), [])
    reqs = [SampleRequest(sampling("digits", temperature=1.0, seed=s, logprobs=2), [5], 1,
                          state.matcher(3 + i)) for i, s in enumerate((7, 8))]
    tokens, lps = Sampler(0)(logits, reqs)
    for row, (t, (lp, _)) in enumerate(zip(tokens, lps)):
        assert tok.decode([t]).isdigit()
        assert lp == float(raw_lp[row, t])  # the same float32 op on the same logits


# Every way a greedy row is sampled: the batched argmax over the whole batch, over a subset
# (another row needs per-row work), with a logit_bias (on a copy), and the per-row argmax
# after a repetition penalty or under a pending min_tokens.
GREEDY_PATHS = {
    "batched_all": dict(),
    "batched_subset": dict(),  # + an unconstrained sampled row in the batch
    "batched_biased": dict(logit_bias_ids=[1], logit_bias_values=[-1.0]),
    "per_row_penalty": dict(repetition_penalty=1.2),
    "per_row_min_tokens": dict(min_tokens=3),
}


@pytest.mark.parametrize("path", list(GREEDY_PATHS))
def test_every_greedy_path_is_masked_when_the_batch_asks_for_logprobs(state, tok, path):
    """With logprobs asked in the batch, the mask goes on a copy of the logits (logprobs
    are the raw ones): every greedy path must read the masked copy. The raw argmax is
    'hen' (outside the digits grammar); the masked argmax is '7'."""
    hen = tok("hen", add_special_tokens=False).input_ids
    seven = tok("7", add_special_tokens=False).input_ids
    assert len(hen) == len(seven) == 1
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, VOCAB, generator=g)
    logits[:, hen[0]] = 20.0
    logits[:, seven[0]] = 10.0
    raw_lp = torch.log_softmax(logits, -1)
    sid = 20 + list(GREEDY_PATHS).index(path)
    state.start(sid, sampling("digits"), [])
    constrained = SampleRequest(sampling("digits", temperature=0.0, logprobs=1,
                                         **GREEDY_PATHS[path]), [5, 5], 2, state.matcher(sid))
    other = SampleRequest(WorkerSampling(temperature=1.0 if path == "batched_subset" else 0.0,
                                         seed=1), [5], 1)
    tokens, lps = Sampler(0)(logits, [constrained, other])
    assert tok.decode([tokens[0]]) == "7", f"{path}: {tok.decode([tokens[0]])!r} is outside [0-9]"
    if path != "batched_subset":
        assert tokens[1] == hen[0]  # the unconstrained greedy row is not masked
    lp, top = lps[0]
    assert lp == float(raw_lp[0, seven[0]])  # the model's own: the same op, the same bits
    assert top[0][0] == hen[0]  # the raw top-1, outside the grammar
    state.drop(sid)


def test_min_tokens_yields_when_only_eos_is_allowed(state, tok):
    done = tok("yes", add_special_tokens=False).input_ids
    state.start(5, sampling("yes"), done)  # replayed: the structure is complete
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS] = -5.0  # EOS is the model's least likely token
    req = SampleRequest(sampling("yes", min_tokens=10), [9] + done, 1, state.matcher(5))
    assert Sampler(0)(logits, [req])[0] == [EOS]
    req_sampled = SampleRequest(sampling("yes", min_tokens=10, temperature=1.0, seed=1),
                                [9] + done, 1, state.matcher(5))
    assert Sampler(0)(logits, [req_sampled])[0] == [EOS]


def test_min_tokens_still_masks_eos_while_the_grammar_allows_more(state, tok):
    state.start(6, sampling("digits"), tok("12", add_special_tokens=False).input_ids)
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS] = 50.0  # EOS is allowed by the grammar now (two digits) and on top
    req = SampleRequest(sampling("digits", min_tokens=5), [9, 1, 2], 1, state.matcher(6))
    (t,), _ = Sampler(0)(logits, [req])
    assert t != EOS and tok.decode([t]).isdigit()


def test_replay_equals_step_by_step_and_terminated_rows_pass(state, tok):
    ids = tok("12", add_special_tokens=False).input_ids
    state.start(7, sampling("digits"), ids)
    state.start(8, sampling("digits"), [])
    for t in ids:
        state.accept(8, t)
    masks = []
    for sid in (7, 8):
        bm = xgr.allocate_token_bitmask(1, VOCAB)
        state.matcher(sid).fill_next_token_bitmask(bm, 0)
        masks.append(bm)
    assert torch.equal(masks[0], masks[1])
    state.accept(7, EOS)
    assert state.matcher(7).is_terminated()
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(2))
    # A step already in flight after the stop token: no mask, no error.
    assert Sampler(0)(logits.clone(), [SampleRequest(sampling("digits"), [1], 1,
                                                     state.matcher(7))])[0] == \
        [int(logits.argmax())]
    state.drop(7)
    assert state.matcher(7) is None


def test_unknown_grammar_is_a_leader_bug(state):
    with pytest.raises(RuntimeError, match="never sent"):
        state.start(9, sampling("nope"), [])


@pytest.mark.parametrize("vocab", [1024, 1000, 37])
def test_native_cpu_mask_equals_xgrammars(vocab):
    """nvllm's vectorised CPU mask (cpu_ops.apply_token_bitmask) sets exactly the logits
    xgrammar's own kernel sets, on the listed rows only, for ragged vocabularies too."""
    from nvllm.kernels import cpu_ops

    if not cpu_ops.load():
        pytest.skip("nvllm's native CPU ops did not build here")
    g = torch.Generator().manual_seed(vocab)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-2**31, 2**31 - 1, (5, words), generator=g, dtype=torch.int32)
    bitmask[1] = -1  # every token allowed: the row is left as it is
    logits = torch.randn(5, vocab, generator=g)
    want, got = logits.clone(), logits.clone()
    xgr.apply_token_bitmask_inplace(want, bitmask, vocab_size=vocab, indices=[0, 1, 3],
                                    backend="cpu")
    cpu_ops.apply_token_bitmask(got, bitmask, [0, 1, 3])
    assert torch.equal(got, want) and torch.equal(got[[2, 4]], logits[[2, 4]])
    assert torch.isneginf(got[0]).any() and torch.equal(got[1], logits[1])
