"""Rank 0's side of structured output: the compiled grammars the leader sent, and one
xgrammar matcher per constrained sequence.

A matcher follows every token its sequence samples (``accept``), so the next step's
mask is ready even when the leader has not seen the token yet (async scheduling). A
sequence that arrives whole (new, or resumed after preemption or a worker restart)
replays its generated tokens into a fresh matcher. The masks themselves are applied by
the sampler (nvllm/worker/sampler.py), in every sampling path.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from nvllm.common import worker_protocol
from nvllm.kernels import cpu_ops

logger = logging.getLogger(__name__)


class StructuredOutputState:
    def __init__(self) -> None:
        self.tokenizer_info: Any = None
        self.grammars: dict[str, Any] = {}  # key -> xgrammar CompiledGrammar
        self.matchers: dict[int, Any] = {}  # seq id -> xgrammar GrammarMatcher

    def load(self, msg: worker_protocol.LoadGrammars) -> None:
        import xgrammar as xgr

        if msg.tokenizer_info is not None:
            self.tokenizer_info = xgr.TokenizerInfo.deserialize_json(msg.tokenizer_info)
        for key in msg.drop:
            self.grammars.pop(key, None)
        if msg.keys and self.tokenizer_info is None:
            raise RuntimeError("grammars arrived before the TokenizerInfo they need")
        for key, data in zip(msg.keys, msg.data):
            self.grammars[key] = xgr.CompiledGrammar.deserialize_json(data,
                                                                      self.tokenizer_info)

    def start(self, seq_id: int, sampling: worker_protocol.WorkerSampling,
              output_token_ids: list[int]) -> None:
        """A fresh matcher for a sequence the workers did not hold, fed the tokens it
        generated already."""
        import xgrammar as xgr

        grammar = self.grammars.get(sampling.grammar_key)
        if grammar is None:  # the leader sends every grammar before the plan using it
            raise RuntimeError(f"sequence {seq_id} needs grammar {sampling.grammar_key}, "
                               "which the leader never sent")
        m = xgr.GrammarMatcher(grammar, override_stop_tokens=sampling.stop_token_ids or None)
        for t in output_token_ids:
            if not m.accept_token(t):
                logger.error("sequence %d: its own token %d does not match its grammar",
                             seq_id, t)
                break
        self.matchers[seq_id] = m

    def drop(self, seq_id: int) -> None:
        self.matchers.pop(seq_id, None)

    def matcher(self, seq_id: int) -> Any:
        return self.matchers.get(seq_id)

    def accept(self, seq_id: int, token: int) -> None:
        m = self.matchers.get(seq_id)
        # A terminated matcher: its sequence ended with that stop token; a step already
        # in flight for it (async scheduling) samples one more token the leader drops.
        if m is not None and not m.is_terminated() and not m.accept_token(token):
            logger.error("sequence %d: sampled token %d outside its grammar", seq_id, token)


def apply_masks(logits: torch.Tensor, matchers: list[Any]) -> torch.Tensor:
    """`logits` with each constrained row's disallowed tokens at -inf (in place);
    matchers[i] is row i's matcher or None. Terminated matchers leave their row as is."""
    import xgrammar as xgr

    rows = [i for i, m in enumerate(matchers) if m is not None and not m.is_terminated()]
    if not rows:
        return logits
    vocab = logits.shape[-1]
    bitmask = xgr.allocate_token_bitmask(len(matchers), vocab)
    for i in rows:
        matchers[i].fill_next_token_bitmask(bitmask, i)
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and cpu_ops.load():
        # xgrammar's CPU kernel is a scalar loop (~3 ms for 64 rows of 16k logits, nearly
        # all masked); nvllm's vectorised one does the same in a fraction.
        cpu_ops.apply_token_bitmask(logits, bitmask, rows)
    else:
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), vocab_size=vocab,
                                        indices=rows)
    return logits
