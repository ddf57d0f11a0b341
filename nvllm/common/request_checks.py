"""The rules a request must meet to be served by this engine, written once.

Every caller reaches the engine through ``nvllm/leader/input_processor.py``, which calls
these: ``LLM.generate`` (no socket, trusted types) and the ZMQ server (after
``nvllm/common/client_decode.py`` has read the frame within its limits). What they judge
depends on the model and on the tokenized prompt, which the wire cannot see: the
vocabulary, max_model_len against the prompt's tokens and max_tokens, max_num_seqs. Each
raises ``RequestRejected`` naming the field and the limit, never echoing a client's value
beyond a count or a position.
"""

from __future__ import annotations

from typing import Any

import msgspec

from nvllm.common.client_limits import ClientLimits, Int64, TtlMs
from nvllm.common.errors import RequestRejected
from nvllm.common.field_errors import fixed_message
from nvllm.common.sampling_params import SamplingParams
from nvllm.common.utils import is_int


def check_scheduling(priority: Any, ttl_ms: Any) -> None:
    """priority and ttl_ms against the types the wire decodes them into (a frame's were
    checked there; a Python caller's are checked here, by the same declaration)."""
    for name, value, kind in (("priority", priority, Int64), ("ttl_ms", ttl_ms, TtlMs | None)):
        try:
            msgspec.convert(value, kind, strict=True)
        except msgspec.ValidationError:
            raise RequestRejected(fixed_message(name)) from None


def check_prompt_ids(ids: Any, limits: ClientLimits) -> list[int]:
    """The prompt's token ids as a list: at least one, all inside the vocabulary, at most
    max_model_len of them."""
    if not isinstance(ids, (list, tuple)) or not ids:
        raise RequestRejected("prompt is empty: give at least one token")
    vocab = limits.vocab_size
    for pos, t in enumerate(ids):
        if not is_int(t) or t < 0 or (vocab is not None and t >= vocab):
            shown = t if isinstance(t, int) else f"of type {type(t).__name__}"
            raise RequestRejected(f"token id {shown} at position {pos} is outside the "
                                  f"vocabulary ({_valid_ids(vocab)})")
    too_long = prompt_length_error(len(ids), limits)
    if too_long:
        raise RequestRejected(too_long)
    return list(ids)


def prompt_length_error(num_tokens: int, limits: ClientLimits) -> str | None:
    """The one rule on a prompt's length, and its message: the engine applies it to every
    tokenized prompt, and the client wire (which bounds prompt_token_ids by the same
    limit while it decodes) answers with this message too."""
    if num_tokens > limits.max_model_len:
        return f"prompt has {num_tokens} tokens, max_model_len is {limits.max_model_len}"
    return None


def check_params(params: SamplingParams, limits: ClientLimits) -> None:
    """What SamplingParams cannot judge alone: token ids inside the vocabulary, and n
    completions that can run together (a huge n is also a cheap way to make the leader
    build millions of sequences)."""
    vocab = limits.vocab_size
    if vocab is not None:
        for name, ids in (("stop_token_ids", params.stop_token_ids or ()),
                          ("logit_bias", params.logit_bias or ())):
            bad = [t for t in ids if t >= vocab]
            if bad:
                raise RequestRejected(f"{name} holds {len(bad)} id(s) outside the "
                                      f"vocabulary ({_valid_ids(vocab)})")
    if params.n > limits.max_num_seqs:
        raise RequestRejected(f"n={params.n} exceeds max_num_seqs {limits.max_num_seqs}; "
                              "ask for fewer completions")


def check_fits(num_prompt_tokens: int, max_tokens: int, limits: ClientLimits) -> None:
    """The prompt and its longest completion fit in max_model_len."""
    n, limit = num_prompt_tokens, limits.max_model_len
    if n + max_tokens > limit:
        raise RequestRejected(
            f"prompt has {n} tokens and max_tokens is {max_tokens}: {n} + {max_tokens} "
            f"exceeds max_model_len {limit}; lower max_tokens to {limit - n} or less")


def check_resume(output_token_ids: Any, text_offset: Any, params: SamplingParams,
                 limits: ClientLimits) -> list[int]:
    """Tokens a resumed completion already produced (Submit.output_token_ids): inside the
    vocabulary, fewer than max_tokens (a completion that produced max_tokens is finished),
    for one completion (n=1: each of n completions has tokens of its own)."""
    if not isinstance(output_token_ids, (list, tuple)):
        raise RequestRejected("output_token_ids must be a list of token ids")
    if params.n != 1:
        raise RequestRejected(f"output_token_ids resumes one completion, but n={params.n}; "
                              "resume each completion as its own request with n=1")
    if len(output_token_ids) >= params.max_tokens:
        raise RequestRejected(f"output_token_ids holds {len(output_token_ids)} tokens; a "
                              f"resumed completion must have fewer than max_tokens "
                              f"({params.max_tokens})")
    vocab = limits.vocab_size
    for pos, t in enumerate(output_token_ids):
        if not is_int(t) or t < 0 or (vocab is not None and t >= vocab):
            raise RequestRejected(f"output_token_ids[{pos}] is outside the vocabulary "
                                  f"({_valid_ids(vocab)})")
    if text_offset is not None and (not is_int(text_offset) or text_offset < 0):
        raise RequestRejected("output_text_offset must be a non-negative integer or null")
    return list(output_token_ids)


def _valid_ids(vocab: int | None) -> str:
    return "token ids are integers from 0" if vocab is None else f"valid ids are 0..{vocab - 1}"
