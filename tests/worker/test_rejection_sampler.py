"""The rejection sampler: each emitted token has exactly the target's distribution.

Closed form (``emitted_distribution``: accept probability x q + rejected mass x residual)
for general and point-mass drafts, with the target processed by temperature, top-k/p,
min-p and penalties as the sampler does; a deliberately wrong rule fails the same check.
Then the sampler's own draws: a derandomised chi-square test over fixed seeds (seeded
requests draw from generators keyed by (seed, position), so it cannot flake), which a
wrong rule fails too.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nvllm.common.worker_protocol import WorkerSampling
from nvllm.worker import rejection_sampler as rs
from nvllm.worker.rejection_sampler import (
    RejectionSampler,
    accept_prob,
    emitted_distribution,
    point_mass,
    residual,
)
from nvllm.worker.sampler import Sampler, SampleRequest, process_row, target_probs

V = 12
PARAMS = [
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=5),
    dict(temperature=1.3, top_p=0.8),
    dict(temperature=0.9, min_p=0.1),
    dict(temperature=1.0, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2),
    dict(temperature=0.8, top_k=6, top_p=0.9, min_p=0.05, logit_bias_ids=[3],
         logit_bias_values=[1.5]),
]


def target(params: dict, seed: int = 0) -> tuple[torch.Tensor, SampleRequest]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(V, generator=g, dtype=torch.float64) * 2
    req = SampleRequest(WorkerSampling(**params), [1, 2, 3, 4, 5, 5], 3)
    return target_probs(process_row(logits.clone(), req), req.params), req


@pytest.mark.parametrize("params", PARAMS)
@pytest.mark.parametrize("draft", ["general", "point", "sparse"])
def test_emitted_distribution_is_the_target(params, draft):
    for seed in range(5):
        p, _ = target(params, seed)
        g = torch.Generator().manual_seed(100 + seed)
        if draft == "general":
            q = torch.rand(V, generator=g, dtype=torch.float64)
        elif draft == "sparse":  # a draft distribution with support outside p's
            q = torch.zeros(V, dtype=torch.float64)
            q[[0, 7, 11]] = torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64)
        else:
            q = point_mass(int(torch.randint(V, (1,), generator=g)), V, p)
        q = q / q.sum()
        torch.testing.assert_close(emitted_distribution(p, q), p, atol=1e-12, rtol=0)


WRONG = {
    "always accept": dict(accept=lambda p, q, x: 1.0),
    "accept with p(x) for any q": dict(accept=lambda p, q, x: float(p[x])),
    "resample from p": dict(resid=lambda p, q: p),
}


@pytest.mark.parametrize("rule", list(WRONG))
def test_a_wrong_rule_fails_the_closed_form(rule):
    p, _ = target(PARAMS[1], 3)
    q = torch.rand(V, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    q /= q.sum()
    assert not torch.allclose(emitted_distribution(p, q, **WRONG[rule]), p, atol=1e-3)


def test_point_mass_rule():
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q = point_mass(1, 3, p)
    assert accept_prob(p, q, 1) == pytest.approx(0.3)
    torch.testing.assert_close(residual(p, q), torch.tensor([5 / 7, 0, 2 / 7],
                                                            dtype=torch.float64))


# Chi-square at significance 1e-4: the critical value for V - 1 = 11 degrees of freedom.
CHI2_CRIT_11 = 37.37
N_SEEDS = 2000


def chi_square(counts: np.ndarray, p: np.ndarray) -> float:
    keep = p > 0
    assert counts[~keep].sum() == 0, "a token outside the target's support"
    e = p[keep] * counts.sum()
    return float(((counts[keep] - e) ** 2 / e).sum())


def first_tokens(params: dict, draft: int) -> tuple[np.ndarray, np.ndarray]:
    """The first emitted token's counts over N_SEEDS seeded requests verifying [draft]."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(2, V, generator=g) * 1.5
    sampler = RejectionSampler(Sampler(0))
    counts = np.zeros(V, np.int64)
    for seed in range(N_SEEDS):
        req = SampleRequest(WorkerSampling(**params, seed=seed), [1, 2, 3], 3)
        counts[sampler.verify(logits, req, [draft])[0]] += 1
    req = SampleRequest(WorkerSampling(**params), [1, 2, 3], 3)
    p = target_probs(process_row(logits[0].clone(), req), req.params).double().numpy()
    return counts, p


@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=0.8, top_k=8)])
def test_draws_follow_the_target_derandomised(params):
    counts, p = first_tokens(params, draft=4)
    assert 0.05 < p[4] < 0.95  # the draft is accepted sometimes, rejected sometimes
    assert chi_square(counts, p) < CHI2_CRIT_11


def test_draws_under_a_wrong_rule_fail_the_chi_square(monkeypatch):
    monkeypatch.setattr(rs, "residual", lambda p, q: p)  # forgets to remove the draft
    counts, p = first_tokens(dict(temperature=1.0), draft=4)
    assert chi_square(counts, p) > CHI2_CRIT_11


def test_greedy_accepts_while_argmax_agrees_and_sees_accepted_drafts():
    logits = torch.full((4, V), -5.0)
    logits[0, 3] = logits[1, 7] = logits[2, 7] = logits[3, 1] = 5.0
    logits[2, 2] = 4.0
    sampler = RejectionSampler(Sampler(0))
    req = SampleRequest(WorkerSampling(), [1, 2], 2)
    assert sampler.verify(logits, req, [3, 7, 7]) == [3, 7, 7, 1]  # all + bonus
    assert sampler.verify(logits, req, [3, 6, 7]) == [3, 7]  # first mismatch: target's
    # A presence penalty at position 2 sees the draft 7 accepted at position 1: 7 drops
    # below 2 there, so the third draft (7) is rejected.
    pen = SampleRequest(WorkerSampling(presence_penalty=2.0), [1, 2], 2)
    assert sampler.verify(logits, pen, [3, 7, 7]) == [3, 7, 2]
    # verify_rows: the batched greedy path agrees with verify
    rows = sampler.verify_rows(torch.cat([logits, logits[1:]]), np.array([0, 4, 7]),
                               [req, req], [np.array([3, 7, 7]), np.array([7, 9])])
    assert rows == [[3, 7, 7, 1], [7, 7]]
