"""The n-gram proposer: longest n first, most recent occurrence, k cut, window budget."""

from __future__ import annotations

import numpy as np

from nvllm.common.sampling_params import SamplingParams
from nvllm.common.speculative import SpeculativeConfig
from nvllm.leader.ngram_proposer import NgramProposer, propose_ngram
from nvllm.leader.sequence import Sequence


def P(tokens, k=3, nmin=1, nmax=3):
    return propose_ngram(np.asarray(tokens, np.int64), k, nmin, nmax).tolist()


def test_match_and_k_cut():
    assert P([1, 2, 3, 4, 5, 6, 1, 2, 3], k=2) == [4, 5]
    assert P([1, 2, 3, 4, 5, 6, 1, 2, 3], k=10) == [4, 5, 6, 1, 2, 3]
    assert P([1, 2, 3, 9, 1, 2, 3], k=10) == [9, 1, 2, 3]  # runs up to the end


def test_no_match_and_too_short():
    assert P([1, 2, 3, 4]) == []
    assert P([7]) == []
    assert P([5, 5], nmin=2) == []  # a 2-gram needs an earlier end
    assert P([1, 2, 9, 2], nmin=2) == []  # only a 1-gram matches


def test_longest_n_preferred_over_recent():
    # "2 3" occurs recently (-> 8), "1 2 3" earlier (-> 4): the longer match wins.
    assert P([1, 2, 3, 4, 0, 2, 3, 8, 1, 2, 3], k=1) == [4]
    # with nmax=2 both are 2-gram matches: the most recent one wins
    assert P([1, 2, 3, 4, 0, 2, 3, 8, 1, 2, 3], k=1, nmax=2) == [8]


def test_most_recent_occurrence():
    assert P([1, 2, 5, 1, 2, 6, 1, 2], k=1, nmin=2, nmax=2) == [6]
    # a match at the very start (shorter than a full window behind it)
    assert P([4, 9, 9, 9, 9, 4], k=2, nmin=1, nmax=3) == [9, 9]


def test_matches_a_brute_force_reference():
    rng = np.random.default_rng(1)
    for _ in range(300):
        L = int(rng.integers(1, 40))
        toks = rng.integers(0, 4, L)
        nmin = int(rng.integers(1, 4))
        nmax = int(rng.integers(nmin, 6))
        k = int(rng.integers(1, 5))
        want = []
        for n in range(min(nmax, L - 1), nmin - 1, -1):
            suffix = toks[L - n:].tolist()
            ends = [e for e in range(n - 1, L - 1) if toks[e - n + 1:e + 1].tolist() == suffix]
            if ends:
                want = toks[ends[-1] + 1:ends[-1] + 1 + k].tolist()
                break
        assert propose_ngram(toks.astype(np.int64), k, nmin, nmax).tolist() == want


def seq(i, tokens):
    return Sequence(i, "r", list(tokens), 2, SamplingParams())


def test_proposer_window_budget_and_incremental_tokens():
    c = SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_min=2,
                          prompt_lookup_max=2, lookup_window=8)
    p = NgramProposer(c)
    s = seq(0, [1, 2, 3] + [0] * 10 + [1, 2])
    assert p.propose([s], 2) == {}  # the earlier "1 2" is outside the 8-token window
    s.token_ids += [3, 4, 1, 2]
    assert p.propose([s], 2)[0].tolist() == [3, 4]  # the new tail was mirrored
    assert p.propose([s], 0) == {}


def test_low_acceptance_pauses_then_retries():
    c = SpeculativeConfig(num_speculative_tokens=2, min_acceptance_rate=0.5,
                          retry_after_tokens=3)
    p = NgramProposer(c)
    s = seq(0, [1, 2, 3, 1, 2])
    p.propose([s], 2)
    p.observe(0, 2, 2, s.num_tokens)
    assert p.eligible(s)
    for _ in range(3):
        p.observe(0, 2, 0, s.num_tokens)
    assert not p.eligible(s) and not p.eligible(s)  # no side effects
    s.token_ids += [7, 8]
    assert not p.eligible(s)
    s.token_ids += [9]
    assert p.eligible(s)  # three tokens later it tries again
    p.drop(0)
    assert p.eligible(s)


def test_a_new_sequence_starts_at_the_recent_acceptance():
    """Drafts nobody accepts (a useless draft model): the first sequence pays for several
    rejected verify steps before it pauses, a later one for one; while drafts were being
    accepted, a new sequence starts trusting them."""
    c = SpeculativeConfig(num_speculative_tokens=2, min_acceptance_rate=0.2,
                          retry_after_tokens=32)
    p = NgramProposer(c)
    first, later = seq(0, [1, 2, 3]), seq(1, [1, 2, 3])
    steps = 0
    while p.eligible(first):
        p.observe(0, 2, 0, first.num_tokens)
        steps += 1
    assert steps == 5  # 1.0 falls under 0.2 after five rejections
    p.observe(1, 2, 0, later.num_tokens)
    assert not p.eligible(later)
    q = NgramProposer(c)
    for i in range(10):
        q.observe(10 + i, 2, 2, 3)
    q.observe(0, 2, 0, first.num_tokens)
    assert q.eligible(first)
