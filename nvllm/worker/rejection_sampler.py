"""Verifying draft tokens on rank 0: speculative decoding's rejection sampling.

A row that verifies d drafts x_1..x_d has d + 1 logits rows: row j is the target's
prediction after the known tokens and x_1..x_j. Position by position, j = 0..d-1:

- the target distribution p_j is the sampler's own, over the row processed exactly as a
  plain sample would be (grammar mask, logit_bias, the min_tokens stop mask, penalties;
  then temperature, top-k, top-p, min-p: ``sampler.process_row``, ``sampler.target_probs``),
  seeing the tokens before the position *including the drafts accepted so far*;
- **greedy**: x_{j+1} is accepted iff it is the argmax of the processed row; else the
  argmax is emitted and the row stops;
- **sampling** (Leviathan et al. 2023; Chen et al. 2023): x_{j+1}, drawn from the draft
  distribution q_j, is accepted with probability min(1, p_j(x) / q_j(x)); else a token is
  drawn from the residual max(p_j - q_j, 0), renormalised, and the row stops. Each emitted
  token then has exactly the target's distribution (``emitted_distribution`` computes it in
  closed form; tests/worker/test_rejection_sampler.py checks it equals p). The n-gram
  proposer's q is a point mass at its draft: accept with probability p(x), else draw from p
  with x removed. A draft model passes its q rows (``draft_probs``).

After all d drafts are accepted, the last row gives the bonus token, drawn (or argmax'd)
as a plain sample. A seeded request draws every position from a CPU generator keyed by
(seed, output position), as the sampler does, so it stays reproducible.

Structured output: the row's matcher masks each position after the drafts accepted before
it (a draft the grammar forbids has p = 0 and is rejected), accepting drafts tentatively;
it is rolled back afterwards, and the model runner advances it by the emitted tokens as it
does for a plain sample.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from nvllm.common.sampling_params import GREEDY_BELOW
from nvllm.worker.sampler import (
    Sampler,
    SampleRequest,
    _needs_row_work,
    argmax_row,
    process_row,
    target_probs,
)
from nvllm.worker.structured_output import apply_masks


def accept_prob(p: torch.Tensor, q: torch.Tensor, x: int) -> float:
    """The chance a draft x (drawn from q) is accepted under target p."""
    qx = float(q[x])
    return 1.0 if qx <= 0.0 else min(1.0, float(p[x]) / qx)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """What a rejected position draws from: max(p - q, 0), renormalised (p itself when
    q covers p, where rejection cannot happen)."""
    r = (p - q).clamp_min(0.0)
    total = r.sum()
    return r / total if float(total) > 0.0 else p


def emitted_distribution(p: torch.Tensor, q: torch.Tensor,
                         accept: Callable = accept_prob,
                         resid: Callable = residual) -> torch.Tensor:
    """The exact distribution of the token one position emits: the draft x ~ q accepted
    (q(x) accept(p, q, x)), or the residual's draw after a rejection. Equals p for the
    rule above (float64 in, float64 out)."""
    acc = torch.tensor([accept(p, q, x) if float(q[x]) > 0 else 0.0
                        for x in range(len(p))], dtype=p.dtype)
    kept = q * acc
    return kept + (1.0 - kept.sum()) * resid(p, q)


def point_mass(x: int, vocab: int, like: torch.Tensor) -> torch.Tensor:
    q = torch.zeros(vocab, dtype=like.dtype, device=like.device)
    q[x] = 1.0
    return q


class RejectionSampler:
    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def verify(self, logits: torch.Tensor, req: SampleRequest, drafts: Sequence[int],
               draft_probs: torch.Tensor | None = None) -> list[int]:
        """The tokens one row emits (its accepted drafts, then the target's own): 1 to
        len(drafts) + 1. `logits`: [len(drafts) + 1, vocab] raw rows (not written);
        `draft_probs`: [len(drafts), vocab] q rows (None: point masses at the drafts)."""
        p = req.params
        greedy = p.temperature < GREEDY_BELOW
        tokens = list(req.token_ids)
        m = req.matcher
        out: list[int] = []
        tentative = 0
        d = len(drafts)
        for j in range(d + 1):
            r = SampleRequest(p, tokens, req.num_prompt_tokens, m)
            row = logits[j].float().clone()
            if m is not None and not m.is_terminated():
                row = apply_masks(row[None], [m])[0]
            row = process_row(row, r)
            if j == d:  # the bonus token: a plain sample
                out.append(argmax_row(row) if greedy
                           else self.sampler.draw(target_probs(row, p), r))
                break
            x = int(drafts[j])
            if greedy:
                top = argmax_row(row)
                if top != x:
                    out.append(top)
                    break
            else:
                probs = target_probs(row, p)
                q = (point_mass(x, probs.shape[0], probs) if draft_probs is None
                     else draft_probs[j].to(probs))
                gen = self.sampler.generator(r, 0, probs.device)
                u = float(torch.rand((), generator=gen, device=gen.device))
                if u >= accept_prob(probs, q, x):
                    out.append(self.sampler.draw(residual(probs, q), r, gen))
                    break
            out.append(x)
            tokens.append(x)
            if m is not None and not m.is_terminated() and m.accept_token(x):
                tentative += 1
        if tentative:
            m.rollback(tentative)
        return out

    def verify_rows(self, logits: torch.Tensor, offsets: np.ndarray,
                    reqs: list[SampleRequest], drafts: list[np.ndarray]) -> list[list[int]]:
        """Every row's emitted tokens; row i's logits are logits[offsets[i]:offsets[i+1]]
        (1 + len(drafts[i]) of them). Plain greedy rows (no penalty, bias, pending
        min_tokens or grammar) take one batched argmax; the others go position by position
        (``verify``)."""
        out: list[list[int]] = [[] for _ in reqs]
        plain = [i for i, r in enumerate(reqs)
                 if not _needs_row_work(r) and r.matcher is None
                 and not r.params.logit_bias_ids]
        if plain:
            idx = np.concatenate([np.arange(offsets[i], offsets[i + 1]) for i in plain])
            top = logits[torch.from_numpy(idx).to(logits.device)].argmax(-1).cpu().numpy()
            pos = 0
            for i in plain:
                d = len(drafts[i])
                t = top[pos:pos + d + 1]
                pos += d + 1
                agree = t[:d] == drafts[i]
                a = d if agree.all() else int(np.argmin(agree))
                out[i] = [int(v) for v in t[:a + 1]]  # a accepted drafts (= t), then t[a]
        done = set(plain)
        for i, r in enumerate(reqs):
            if i not in done:
                out[i] = self.verify(logits[int(offsets[i]):int(offsets[i + 1])], r,
                                     drafts[i].tolist())
        return out
