"""The one way into the engine: turn what a caller asked for into a checked ``Request``.

``LLM.generate`` calls it directly and the ZMQ server calls it for each ``Submit``
message (the HTTP gateway's requests arrive as those). It tokenizes, checks the request
against the engine's limits and builds the request's n sequences; it reads no scheduler
state, so a request that fails here has changed nothing.
"""

from __future__ import annotations

import itertools
from typing import Any

from nvllm.common.client_limits import client_limits
from nvllm.common.config import EngineConfig
from nvllm.common.errors import RequestRejected
from nvllm.common.request_checks import (
    check_fits,
    check_params,
    check_prompt_ids,
    check_resume,
    check_scheduling,
)
from nvllm.common.sampling_params import SamplingParams
from nvllm.common.utils import cdiv
from nvllm.leader.request import Request
from nvllm.leader.sequence import Sequence


class InputProcessor:
    def __init__(self, config: EngineConfig, tokenizer: Any, capacity_tokens: int) -> None:
        assert config.model_info is not None, "EngineConfig.finalize() first"
        self.config = config
        self.limits = client_limits(config)  # the same limits the client wire enforces
        self.tokenizer = tokenizer
        self.vocab_size = config.model_info.vocab_size
        self.eos_token_ids = list(config.model_info.eos_token_ids)
        self.capacity_tokens = capacity_tokens
        self._request_ids = itertools.count()
        self._seq_ids = itertools.count()

    def process(self, prompt: str | list[int] | None = None,
                params: SamplingParams | None = None, request_id: str | None = None,
                prompt_token_ids: list[int] | None = None, priority: int = 0,
                ttl_ms: float | None = None, output_token_ids: list[int] | None = None,
                output_text_offset: int | None = None) -> Request:
        """A request ready to admit, or RequestRejected saying which limit it breaks.

        output_token_ids: a completion resumed from elsewhere (a data-parallel replay):
        its sequence starts with them as outputs already produced, which max_tokens
        counts, penalties, min_tokens and the grammar see, and whose text the detokenizer
        continues after output_text_offset characters (OutputProcessor.add_request)."""
        params = params or SamplingParams()
        check_scheduling(priority, ttl_ms)
        text = None
        if prompt_token_ids is None:
            if isinstance(prompt, str):
                if self.tokenizer is None:
                    raise RequestRejected("the engine was started without a tokenizer "
                                          "(skip_tokenizer_init): pass prompt token ids")
                text = prompt
                prompt_token_ids = self.tokenizer(prompt).input_ids
            else:
                prompt_token_ids = prompt
        ids = self._validate(prompt_token_ids, params)
        produced = [] if output_token_ids is None else check_resume(
            output_token_ids, output_text_offset, params, self.limits)
        params = params.clone(eos_token_ids=self.eos_token_ids)
        if params.stop and self.tokenizer is None:
            raise RequestRejected("stop strings need a tokenizer (the engine has none)")
        if request_id is None:
            request_id = str(next(self._request_ids))
        req = Request(request_id, text, ids, params, priority=priority,
                      resume_text_offset=output_text_offset if produced else None)
        if ttl_ms is not None:
            req.deadline = req.arrival_time + ttl_ms / 1000.0
        for i in range(params.n):
            # Seeded completions of one request draw from consecutive seeds.
            p = params if params.n == 1 or params.seed is None else params.clone(
                seed=(params.seed + i) % 2**63)
            req.seqs.append(Sequence(next(self._seq_ids), request_id, ids + produced,
                                     len(ids), p, index=i, priority=priority,
                                     wants_prompt_logprobs=i == 0 and p.prompt_logprobs
                                     is not None))
        return req

    def _kv_tokens_needed(self, num_tokens: int) -> int:
        """KV a sequence of num_tokens holds at its peak: all of them, or, when every
        layer slides, its window and one step's tokens (blocks behind the window go back
        to the pool: nvllm/leader/kv_cache_manager.py)."""
        window = self.config.model_info.kv_window
        if window is None:
            return num_tokens
        bs = self.config.block_size
        return min(num_tokens,
                   (cdiv(window + self.config.max_num_batched_tokens, bs) + 1) * bs)

    def _validate(self, ids: Any, params: SamplingParams) -> list[int]:
        ids = check_prompt_ids(ids, self.limits)
        check_params(params, self.limits)
        n = len(ids)
        check_fits(n, params.max_tokens, self.limits)
        if self._kv_tokens_needed(n + params.max_tokens) > self.capacity_tokens:
            raise RequestRejected(
                f"prompt has {n} tokens and max_tokens is {params.max_tokens}, but the KV "
                f"cache holds only {self.capacity_tokens} tokens in all; raise num_kv_blocks "
                "(or the KV memory budget) or shorten the request")
        return ids
