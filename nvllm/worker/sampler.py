"""Token sampling on rank 0 from full-vocabulary float32 logits.

Order (as vLLM v1, whose grammar bitmask comes first and whose logits processors run
before its penalties): grammar mask (structured output) -> logit_bias -> min_tokens mask
-> penalties -> greedy argmax, or temperature -> top-k -> top-p -> min-p -> a draw.
Returned logprobs are the model's own (log_softmax of the raw logits, before the mask,
the bias and every other step; vLLM's default ``raw_logprobs``): a bias changes which
token is picked, not the logprobs reported. A seeded sequence draws from a generator
keyed by (seed, output position), so its tokens do not depend on what else is in the
batch, nor on preemption.

Plain greedy rows (no penalty, no pending min_tokens) take one batched argmax, their
logit_bias added first on a copy of just those rows, so a biased greedy request does not
push the rest of the batch onto the per-row path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

from nvllm.common.sampling_params import GREEDY_BELOW
from nvllm.common.worker_protocol import WorkerSampling
from nvllm.kernels import cpu_ops
from nvllm.worker.structured_output import apply_masks


@dataclass(slots=True)
class SampleRequest:
    params: WorkerSampling
    token_ids: Sequence[int]  # prompt + generated so far (a list, or the batch row's view)
    num_prompt_tokens: int
    matcher: Any = None  # xgrammar GrammarMatcher of a constrained sequence


def _apply_bias(row: torch.Tensor, p: WorkerSampling) -> torch.Tensor:
    if p.logit_bias_ids:
        # Ids are unique (a map's keys) and inside the vocabulary (the leader checked).
        row[torch.tensor(p.logit_bias_ids, dtype=torch.long, device=row.device)] += \
            torch.tensor(p.logit_bias_values, dtype=row.dtype, device=row.device)
    return row


def _apply_penalties(row: torch.Tensor, req: SampleRequest) -> torch.Tensor:
    p = req.params
    vocab = row.shape[0]
    if p.repetition_penalty == 1.0 and not (p.presence_penalty or p.frequency_penalty):
        return row
    ids = torch.as_tensor(req.token_ids, dtype=torch.long, device=row.device)
    if p.repetition_penalty != 1.0:
        seen = ids[ids < vocab].unique()
        if seen.numel():
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / p.repetition_penalty,
                                    vals * p.repetition_penalty)
    if p.presence_penalty or p.frequency_penalty:
        out = ids[req.num_prompt_tokens:]
        out = out[out < vocab]
        if out.numel():
            counts = torch.bincount(out, minlength=vocab).float()
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
    return row


def _filter(row: torch.Tensor, p: WorkerSampling) -> torch.Tensor:
    if p.top_k > 0 and p.top_k < row.shape[0]:
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, idx = torch.sort(row, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) > p.top_p  # keep the token crossing top_p
        row = row.clone()
        row[idx[drop]] = float("-inf")
    if p.min_p > 0.0:
        probs = row.softmax(-1)
        row = row.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    return row


def logprob_entry(lp: torch.Tensor, token: int, k: int) -> list:
    """One StepResult.logprobs entry from a row of log-probabilities: [logprob of `token`,
    [[id, logprob], ...the top k]]."""
    pairs = []
    if k > 0:
        top = torch.topk(lp, k)
        pairs = [[int(t), float(v)] for v, t in zip(top.values.tolist(), top.indices.tolist())]
    return [float(lp[token]), pairs]


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) of [B, V] logits: the same indices, through the native CPU
    op where it applies (torch's CPU argmax is a scalar loop: ~1 ms of a 64-sequence decode
    step over a 16k vocabulary, ~0.1 ms native)."""
    if (x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2
            and x.stride(1) == 1 and x.shape[1] > 0 and cpu_ops.load()):
        return cpu_ops.argmax_rows(x)
    return x.argmax(dim=-1)


def argmax_row(row: torch.Tensor) -> int:
    return int(argmax_rows(row[None])[0])


def _generator(seed: int, position: int) -> torch.Generator:
    key = xxhash.xxh64_intdigest(f"{seed}:{position}".encode()) & (2**63 - 1)
    return torch.Generator().manual_seed(key)


def _needs_row_work(req: SampleRequest) -> bool:
    """Whether the row needs more than a (biased) argmax."""
    p = req.params
    return (p.temperature >= GREEDY_BELOW or p.repetition_penalty != 1.0
            or bool(p.presence_penalty) or bool(p.frequency_penalty)
            or (p.min_tokens > 0 and len(req.token_ids) - req.num_prompt_tokens < p.min_tokens))


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def _device_generator(self, device: torch.device) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            gen = self._generators[device] = torch.Generator(device).manual_seed(self.seed)
        return gen

    def __call__(self, logits: torch.Tensor, reqs: list[SampleRequest]):
        """Returns (token ids, logprobs per row or None). Constrained rows of `logits` are
        masked in place (on a copy when logprobs are asked: those are the raw ones)."""
        raw = logits
        if any(r.matcher is not None for r in reqs):
            wants_raw = any(r.params.logprobs is not None for r in reqs)
            logits = apply_masks(logits.clone() if wants_raw else logits,
                                 [r.matcher for r in reqs])
        plain = [i for i, r in enumerate(reqs) if not _needs_row_work(r)]
        tokens: list[int] = [0] * len(reqs)
        if plain:
            for i, t in zip(plain, self._greedy_rows(logits, reqs, plain)):
                tokens[i] = t
        if len(plain) < len(reqs):
            done = set(plain)
            for i, req in enumerate(reqs):
                if i not in done:
                    tokens[i] = self._sample_row(logits[i].clone(), req)
        logprobs = None
        if any(r.params.logprobs is not None for r in reqs):
            lp = torch.log_softmax(raw, dim=-1)
            logprobs = []
            for i, req in enumerate(reqs):
                k = req.params.logprobs
                if k is None:
                    logprobs.append(None)
                    continue
                logprobs.append(logprob_entry(lp[i], tokens[i], k))
        return tokens, logprobs

    @staticmethod
    def _greedy_rows(logits: torch.Tensor, reqs: list[SampleRequest], rows: list[int]
                     ) -> list[int]:
        """One batched argmax over `rows` (all of them plain greedy), each row's logit_bias
        added first with one index_put on a copy, so `logits` is not written."""
        x = logits if len(rows) == len(reqs) else logits[rows]  # a subset: a copy already
        biased = [(j, reqs[i].params) for j, i in enumerate(rows)
                  if reqs[i].params.logit_bias_ids]
        if biased:
            if x is logits:
                x = logits.clone()
            r = [j for j, p in biased for _ in p.logit_bias_ids]
            c = [t for _, p in biased for t in p.logit_bias_ids]
            v = [b for _, p in biased for b in p.logit_bias_values]
            dev = x.device
            x.index_put_((torch.tensor(r, dtype=torch.long, device=dev),
                          torch.tensor(c, dtype=torch.long, device=dev)),
                         torch.tensor(v, dtype=x.dtype, device=dev), accumulate=True)
        return argmax_rows(x).tolist()

    def _sample_row(self, row: torch.Tensor, req: SampleRequest) -> int:
        p = req.params
        row = process_row(row, req)
        if p.temperature < GREEDY_BELOW:
            return argmax_row(row)
        probs = target_probs(row, p)
        return self.draw(probs, req)

    def generator(self, req: SampleRequest, offset: int = 0,
                  device: torch.device | None = None) -> torch.Generator:
        """What a draw for `req`'s token `offset` positions after its next uses: the
        engine's generator on `device`, or for a seeded request a CPU one keyed by (seed,
        output position), so a seed gives the same tokens in any batch or device."""
        p = req.params
        if p.seed is None:
            return self._device_generator(device or torch.device("cpu"))
        return _generator(p.seed, len(req.token_ids) - req.num_prompt_tokens + offset)

    def draw(self, probs: torch.Tensor, req: SampleRequest,
             gen: torch.Generator | None = None) -> int:
        """One token from `probs` (the exponential race: argmax(p / E), E ~ Exp(1)); `gen`
        defaults to ``generator(req)``."""
        if gen is None:
            gen = self.generator(req, 0, probs.device)
        if gen.device == probs.device:
            q = torch.empty_like(probs).exponential_(generator=gen)
        else:  # a seeded (CPU) generator: the same tokens on every device
            q = torch.empty(probs.shape, dtype=probs.dtype).exponential_(
                generator=gen).to(probs.device)
        return argmax_row(probs / q)


def process_row(row: torch.Tensor, req: SampleRequest) -> torch.Tensor:
    """A row of logits (grammar mask already applied) after logit_bias, the min_tokens
    stop mask and the penalties: what greedy takes the argmax of, and what temperature
    and the filters turn into the target distribution (``target_probs``). In place."""
    p = req.params
    row = _apply_bias(row, p)
    n_out = len(req.token_ids) - req.num_prompt_tokens
    if n_out < p.min_tokens and p.stop_token_ids:
        ids = [t for t in p.stop_token_ids if t < row.shape[0]]
        kept = row[ids]
        row[ids] = float("-inf")
        if req.matcher is not None and bool(torch.isneginf(row).all()):
            # The grammar allows only a stop token: the structure is complete, and
            # ends the output before min_tokens rather than leave nothing to sample.
            row[ids] = kept
    return _apply_penalties(row, req)


def target_probs(row: torch.Tensor, p: WorkerSampling) -> torch.Tensor:
    """The distribution a (non-greedy) token is drawn from: temperature, top-k, top-p,
    min-p over a processed row (``process_row``)."""
    return _filter(row / p.temperature, p).softmax(-1)
