"""The n-gram (prompt lookup) proposer: draft tokens from each sequence's own context.

For a decoding sequence whose tokens (prompt + output) end in the n-gram g, find the most
recent earlier occurrence of g (n from ``prompt_lookup_max`` down to ``prompt_lookup_min``:
the longest n that matches anywhere wins) and propose the up-to-k tokens that followed it.

Vectorised: per sequence, one ``sliding_window_view`` comparison of the last ``W`` tokens
(``SpeculativeConfig.lookup_window``, default 1024: the tokens scanned per sequence and
step are bounded by it, whatever the context length) against the suffix, for every n at
once: for every candidate end i, how many tokens going back from i agree with the
suffix (capped at prompt_lookup_max); the longest run wins, the most recent end among
equals (no Python loop per position). Each sequence's tokens are mirrored in a growing numpy
array (``Sequence.token_ids`` stays a list; only the new tail is copied per call).

Cost, measured on this 2-core machine (``python -m nvllm.leader.ngram_proposer``, 2k-token
contexts of random tokens from a 1k vocabulary, window 1024, k 4, n 5..2): one
``propose`` call takes ~1.2 ms at 16 sequences and ~4.9 ms at 64 (~75 us per sequence),
against a decode step of tens of ms on CPU.

Adaptive state (per sequence, here, not on the ``Sequence``): ``AcceptanceGate``, which the
draft-model proposer (nvllm/leader/draft_proposer.py) shares: an exponential moving average
of the acceptance rate; under ``min_acceptance_rate`` the sequence stops proposing until it
has generated ``retry_after_tokens`` more tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from nvllm.common.speculative import SpeculativeConfig
from nvllm.leader.sequence import Sequence

EMA_WEIGHT = 0.3  # of the newest verify step in an acceptance average


@dataclass(slots=True)
class _SeqState:
    tokens: np.ndarray  # capacity-sized; the first n are the sequence's tokens
    n: int = 0


@dataclass(slots=True)
class _Acceptance:
    value: float = 1.0  # EMA of accepted / drafted
    paused_until: int = 0  # its length (tokens) from which it may propose again


class AcceptanceGate:
    """The adaptive rule every proposer shares: per sequence, an exponential moving
    average of its acceptance rate; under ``min_acceptance_rate`` it stops proposing until
    it has generated ``retry_after_tokens`` more tokens (a function of its length, so a
    paused sequence resumes whether or not anyone asks meanwhile).

    A sequence's average starts at the acceptance every sequence has had recently (1.0
    before any): how well the drafts agree is mostly the proposer's and the model's, so
    where they never do (a useless draft model) a new sequence pauses after its first
    rejected verify step instead of paying for several (each new request would otherwise
    repeat them)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self._seqs: dict[int, _Acceptance] = {}
        self.recent = 1.0  # moving average of the acceptance over every verify step

    def eligible(self, seq: Sequence) -> bool:
        """Whether the sequence may propose (not paused for low acceptance); no side
        effects."""
        st = self._seqs.get(seq.seq_id)
        return st is None or seq.num_tokens >= st.paused_until

    def observe(self, seq_id: int, num_drafted: int, num_accepted: int,
                num_tokens: int = 0) -> None:
        """One verify step's outcome for a sequence (`num_tokens`: its length after it):
        update its acceptance average and pause it below the threshold."""
        if num_drafted <= 0:
            return
        c = self.config
        st = self._seqs.get(seq_id)
        if st is None:
            st = self._seqs[seq_id] = _Acceptance(max(self.recent, c.min_acceptance_rate))
        rate = num_accepted / num_drafted
        st.value += EMA_WEIGHT * (rate - st.value)
        self.recent += EMA_WEIGHT * (rate - self.recent)
        if st.value < c.min_acceptance_rate:
            st.paused_until = (num_tokens + c.retry_after_tokens if c.retry_after_tokens
                               else 1 << 62)
            st.value = c.min_acceptance_rate  # a retry starts at the threshold

    def drop(self, seq_id: int) -> None:
        self._seqs.pop(seq_id, None)


def propose_ngram(tokens: np.ndarray, k: int, nmin: int, nmax: int) -> np.ndarray:
    """Up to k tokens that followed the most recent earlier occurrence of the longest
    suffix n-gram of `tokens` (n in nmin..nmax); empty when none matches. `tokens`: the
    window to search (its end is the sequence's end; int64, ids >= 0)."""
    L = len(tokens)
    nmax = min(nmax, L - 1)
    if nmax < nmin or k < 1:
        return tokens[:0]
    # Every candidate end i (0..L-2: a token must follow) gets a full window of the nmax
    # tokens ending at i; -1 pads the start (no token id equals it).
    padded = np.concatenate([np.full(nmax - 1, -1, tokens.dtype), tokens[:L - 1]])
    win = sliding_window_view(padded, nmax)  # [L - 1, nmax]: win[i, -1] = tokens[i]
    rev = (win == tokens[L - nmax:])[:, ::-1]  # rev[i, j]: tokens[i - j] == tokens[L-1-j]
    run = np.where(rev.all(axis=1), nmax, np.argmin(rev, axis=1))  # agreeing run, back
    best = int(run.max())
    if best < nmin:
        return tokens[:0]
    end = int(np.flatnonzero(run >= best)[-1])  # the most recent of the longest
    return tokens[end + 1:end + 1 + k]


class GatedProposer:
    """What every proposer shares: its config, k, and the per-sequence AcceptanceGate
    (``eligible``, ``observe``, ``drop``); a subclass proposes and forgets its own state
    of a sequence (``_forget``)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        self._gate = AcceptanceGate(config)

    def eligible(self, seq: Sequence) -> bool:
        """Whether the sequence may propose (AcceptanceGate.eligible)."""
        return self._gate.eligible(seq)

    def observe(self, seq_id: int, num_drafted: int, num_accepted: int,
                num_tokens: int = 0) -> None:
        """One verify step's outcome for a sequence (AcceptanceGate.observe)."""
        self._gate.observe(seq_id, num_drafted, num_accepted, num_tokens)

    def drop(self, seq_id: int) -> None:
        self._forget(seq_id)
        self._gate.drop(seq_id)

    def _forget(self, seq_id: int) -> None:
        raise NotImplementedError


class NgramProposer(GatedProposer):
    def __init__(self, config: SpeculativeConfig) -> None:
        super().__init__(config)
        self.nmin = config.prompt_lookup_min
        self.nmax = config.prompt_lookup_max
        self.window = config.lookup_window
        self._seqs: dict[int, _SeqState] = {}

    def _state(self, seq: Sequence) -> _SeqState:
        st = self._seqs.get(seq.seq_id)
        if st is None:
            st = self._seqs[seq.seq_id] = _SeqState(np.empty(max(64, 2 * seq.num_tokens),
                                                             np.int64))
        n = seq.num_tokens
        if n > st.n:
            if n > len(st.tokens):
                grown = np.empty(2 * n, np.int64)
                grown[:st.n] = st.tokens[:st.n]
                st.tokens = grown
            st.tokens[st.n:n] = seq.token_ids[st.n:n]
            st.n = n
        elif n < st.n:  # (never shrinks today; a recompute that did would resync)
            st.n = n
        return st

    def propose(self, seqs: list[Sequence], k: int) -> dict[int, np.ndarray]:
        """Draft tokens (up to k) per sequence id, for those with a match."""
        out: dict[int, np.ndarray] = {}
        if k < 1:
            return out
        for seq in seqs:
            st = self._state(seq)
            toks = st.tokens[max(0, st.n - self.window):st.n]
            d = propose_ngram(toks, k, self.nmin, self.nmax)
            if len(d):
                out[seq.seq_id] = d.copy()
        return out

    def _forget(self, seq_id: int) -> None:
        self._seqs.pop(seq_id, None)


def _bench() -> None:  # pragma: no cover - a measurement, quoted in the docstring
    import time

    from nvllm.common.sampling_params import SamplingParams

    rng = np.random.default_rng(0)
    reps = 50
    for num in (16, 64):
        toks = [rng.integers(0, 1000, 2048 + reps).tolist() for _ in range(num)]
        # One Sequence per call (a token more each time), built outside the timing.
        calls = [[Sequence(i, "r", toks[i][:2048 + r], 1024, SamplingParams())
                  for i in range(num)] for r in range(reps + 1)]
        p = NgramProposer(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=5,
                                            prompt_lookup_min=2))
        p.propose(calls[0], 4)
        t0 = time.perf_counter()
        for seqs in calls[1:]:
            p.propose(seqs, 4)
        print(f"{num} sequences: {(time.perf_counter() - t0) / reps * 1e3:.2f} ms per call")


if __name__ == "__main__":  # pragma: no cover
    _bench()
