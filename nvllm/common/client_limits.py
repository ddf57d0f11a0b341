"""The bounds on what one client request may carry, built from the engine's config.

``client_limits`` is the one place a request bound comes from: the typed client messages
(nvllm/common/client_decode.py) turn these numbers into their field constraints, and the
engine's way in (nvllm/leader/input_processor.py) reads the model-dependent ones
(``max_model_len``, ``vocab_size``, ``max_num_seqs``) from here too, so an operator's flag
changes every check that uses it and no default is written twice.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated

from msgspec import Meta

if TYPE_CHECKING:
    from nvllm.common.config import EngineConfig

PROMPT_BYTES_PER_TOKEN = 32  # max_prompt_bytes' default, per token of max_model_len
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_LOGPROBS = 20  # logprobs and prompt_logprobs: the top-k any request may ask for
# Bounds that are the same for every engine, as types: the wire decodes into them and
# the engine's way in converts into them (nvllm/common/request_checks.py).
Int64 = Annotated[int, Meta(ge=INT64_MIN, le=INT64_MAX)]
TokenId = Annotated[int, Meta(ge=0, le=INT64_MAX)]
# A positive, finite number of milliseconds (NaN fails every bound, inf this one).
TtlMs = Annotated[float, Meta(gt=0, le=1.7976931348623157e308)]
# A config not yet finalized has no max_model_len: what limits assume without a model.
UNRESOLVED_MAX_MODEL_LEN = 4096


@dataclass(frozen=True, slots=True)
class ClientLimits:
    """Every bound on one request. Built by ``client_limits`` (or, in tests, with every
    field given): there are no defaults here, EngineConfig's are the only ones."""

    max_model_len: int
    vocab_size: int | None  # None: no model known (a decoder without an engine)
    max_num_seqs: int
    max_request_id_bytes: int
    max_prompt_bytes: int
    max_n: int
    max_stop_strings: int
    max_stop_string_chars: int
    max_stop_token_ids: int
    max_grammar_bytes: int
    max_logit_bias: int


def client_limits(config: EngineConfig) -> ClientLimits:
    """The limits a request to an engine with ``config`` must fit. Works on a finalized
    config (the model's max_model_len and vocabulary) and on a bare one (the defaults,
    no vocabulary)."""
    max_model_len = config.max_model_len or UNRESOLVED_MAX_MODEL_LEN
    info = config.model_info
    return ClientLimits(
        max_model_len=max_model_len,
        vocab_size=info.vocab_size if info is not None else None,
        max_num_seqs=config.max_num_seqs,
        max_request_id_bytes=config.max_request_id_bytes,
        max_prompt_bytes=config.max_prompt_bytes or max_model_len * PROMPT_BYTES_PER_TOKEN,
        max_n=config.max_n,
        max_stop_strings=config.max_stop_strings,
        max_stop_string_chars=config.max_stop_string_chars,
        max_stop_token_ids=config.max_stop_token_ids,
        max_grammar_bytes=config.max_grammar_bytes,
        max_logit_bias=config.max_logit_bias,
    )


@functools.cache
def default_limits() -> ClientLimits:
    """The limits of an engine started with every default (and no model yet)."""
    from nvllm.common.config import EngineConfig

    return client_limits(EngineConfig(model=""))


# Bounds on the weight-update sources a client names (init_weight_update_group,
# update_weights_from_distributed, update_weights_from_path): the same for every engine.
MAX_MASTER_ADDRESS_CHARS = 255  # a DNS name's longest
MIN_PORT, MAX_PORT = 1, 65535
MAX_GROUP_WORLD_SIZE = 4096
MAX_GROUP_NAME_CHARS = 128
MAX_GROUP_TIMEOUT_S = 600.0
MAX_PATH_CHARS = 4096  # PATH_MAX
MAX_TENSOR_DIMS = 8
# update_weights_from_distributed over HTTP names every tensor in one body (the client
# then sends them MAX_TENSORS_PER_CHUNK a message): far above any served model's count.
MAX_TENSORS_PER_UPDATE = 1 << 16
GROUP_BACKENDS = ("gloo", "nccl")


def weight_group_error(master_address: object, master_port: object, rank_offset: object,
                       world_size: object, group_name: object, backend: object,
                       timeout_s: object, tp: int | None = None) -> str | None:
    """Why these init_weight_update_group arguments are refused (naming the field and
    its limit), or None. `tp`, when known: the workers that must fit in the group."""
    def bad_int(x: object, lo: int, hi: int) -> bool:
        return type(x) is not int or not lo <= x <= hi

    if not isinstance(master_address, str) or \
            not 0 < len(master_address) <= MAX_MASTER_ADDRESS_CHARS:
        return f"master_address must be 1 to {MAX_MASTER_ADDRESS_CHARS} characters"
    if bad_int(master_port, MIN_PORT, MAX_PORT):
        return f"master_port must be an integer in {MIN_PORT}..{MAX_PORT}"
    if bad_int(world_size, 2, MAX_GROUP_WORLD_SIZE):
        return f"world_size must be an integer in 2..{MAX_GROUP_WORLD_SIZE}"
    if bad_int(rank_offset, 1, MAX_GROUP_WORLD_SIZE - 1):
        return (f"rank_offset must be an integer in 1..{MAX_GROUP_WORLD_SIZE - 1} (the "
                "trainer is rank 0)")
    if tp is not None and rank_offset + tp > world_size:
        return (f"rank_offset {rank_offset} + tensor_parallel_size {tp} exceeds world_size "
                f"{world_size}: every worker needs a rank in the group")
    if not isinstance(group_name, str) or not 0 < len(group_name) <= MAX_GROUP_NAME_CHARS:
        return f"group_name must be 1 to {MAX_GROUP_NAME_CHARS} characters"
    if backend is not None and backend not in GROUP_BACKENDS:
        return f"backend must be one of {GROUP_BACKENDS} (or None: by device)"
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or \
            not 0 < timeout_s <= MAX_GROUP_TIMEOUT_S:
        return f"timeout_s must be in (0, {MAX_GROUP_TIMEOUT_S:g}] seconds"
    return None
