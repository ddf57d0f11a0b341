"""Per-request sampling parameters (vLLM conventions)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from nvllm.common.client_limits import MAX_LOGPROBS
from nvllm.common.structured_outputs import StructuredOutputsParams
from nvllm.common.utils import INT64_MAX, is_int, shown

# Below this temperature, logits / T overflows float32: the sampler takes the argmax
# (as vLLM does), so such requests are greedy.
GREEDY_BELOW = 1e-5
# logit_bias: OpenAI's value range, and the most entries any request may carry (operators
# set a lower per-request bound, max_logit_bias, on the wire; this one guards LLM(...) and
# any other caller from a map the workers would rebuild every step).
LOGIT_BIAS_MAX = 100.0
LOGIT_BIAS_MAX_ENTRIES = 65536


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    stop: list[str] | None = None  # stop strings: the text ends before the first one found
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # The output must match this (a JSON schema, regex, grammar or choice): see
    # nvllm/common/structured_outputs.py. A dict is accepted and converted.
    structured_outputs: StructuredOutputsParams | None = None
    # token id -> added to its logit before penalties and temperature (OpenAI/vLLM); keys
    # may be decimal strings (as JSON sends them) and become ints.
    logit_bias: dict[int, float] | None = None
    # Filled by the engine from the checkpoint's generation config, not by users.
    eos_token_ids: list[int] = field(default_factory=list, repr=False)
    # Score the prompt too (vLLM's prompt_logprobs): each prompt token after the first gets
    # its logprob and the top-k (k = this, 0..20); the first gets None. Computed in the
    # prefill only when asked, once per request; see RequestOutput.prompt_logprobs.
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"SamplingParams.{name}: {why} (got {shown(getattr(self, name))})")

        def is_num(v: Any) -> bool:
            return (isinstance(v, (int, float)) and not isinstance(v, bool)
                    and math.isfinite(v))

        if not is_int(self.n) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        if not is_num(self.temperature) or self.temperature < 0:
            raise bad("temperature", "must be a finite number >= 0 (0 means greedy)")
        if not is_num(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if not is_int(self.top_k) or self.top_k < -1:
            raise bad("top_k", "must be an integer; 0 or -1 disables it")
        if not is_num(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", "must be in [0, 1]")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed <= INT64_MAX):
            raise bad("seed", "must be None or an integer in [0, 2**63)")
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise bad("max_tokens", "must be an integer >= 1")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", "must be an integer >= 0")
        if self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
                is_int(t) and t >= 0 for t in self.stop_token_ids
            ):
                raise bad("stop_token_ids", "must be a list of non-negative integers")
            self.stop_token_ids = list(self.stop_token_ids)
        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", "must be a bool")
        if not is_num(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "must be a number > 0 (1.0 disables it)")
        if not is_num(self.presence_penalty) or not -2 <= self.presence_penalty <= 2:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if not is_num(self.frequency_penalty) or not -2 <= self.frequency_penalty <= 2:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None:
            if not isinstance(self.stop, (list, tuple)) or not all(
                    isinstance(x, str) and x for x in self.stop):
                raise bad("stop", "must be a string or a list of non-empty strings")
            self.stop = list(self.stop)
        for name in ("include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "must be a bool")
        try:
            self.structured_outputs = StructuredOutputsParams.from_any(self.structured_outputs)
        except (TypeError, ValueError) as e:
            raise ValueError(f"SamplingParams.{e}" if str(e).startswith("structured_outputs")
                             else f"SamplingParams.structured_outputs: {e}") from None
        if self.structured_outputs is not None and self.ignore_eos:
            # A constrained output ends when its structure is complete, with EOS.
            raise ValueError("SamplingParams.ignore_eos cannot be combined with "
                             "structured_outputs: a constrained output ends with EOS once "
                             "its structure is complete")
        if self.logit_bias is not None:
            self.logit_bias = _checked_logit_bias(self.logit_bias)
        for name in ("logprobs", "prompt_logprobs"):
            lp = getattr(self, name)
            if lp is not None and (not is_int(lp) or not 0 <= lp <= MAX_LOGPROBS):
                raise bad(name, f"must be None or an integer in [0, {MAX_LOGPROBS}]")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    def all_stop_token_ids(self) -> set[int]:
        ids = set(self.stop_token_ids or ())
        if not self.ignore_eos:
            ids.update(self.eos_token_ids)
        return ids

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if self.structured_outputs is not None:
            d["structured_outputs"] = self.structured_outputs.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        unknown = [k for k in d if k not in cls.__dataclass_fields__]
        if unknown:
            # A field name is named; anything else a client sent as a key is not echoed.
            names = ", ".join(repr(k) if isinstance(k, str) and k.isidentifier()
                              and len(k) <= 40 else shown(k) for k in unknown[:3])
            raise ValueError(f"unknown sampling parameter(s): {names}"
                             + (f" and {len(unknown) - 3} more" if len(unknown) > 3 else ""))
        return cls(**d)

    def clone(self, **changes: Any) -> SamplingParams:
        d = self.to_dict()
        d.update(changes)
        return SamplingParams(**d)


def _checked_logit_bias(bias: Any) -> dict[int, float]:
    """``bias`` as {token id: float}, or ValueError naming the field and the bound broken
    (never a key or value the client sent: messages reach clients and logs)."""
    def bad(why: str) -> ValueError:
        return ValueError(f"SamplingParams.logit_bias: {why}")

    if not isinstance(bias, dict):
        raise bad(f"must be a map of token id to bias (got {shown(bias)})")
    if len(bias) > LOGIT_BIAS_MAX_ENTRIES:
        raise bad(f"has {len(bias)} entries, more than {LOGIT_BIAS_MAX_ENTRIES}")
    out: dict[int, float] = {}
    for k, v in bias.items():
        if isinstance(k, str) and k.isascii() and k.isdigit() and len(k) <= 19:
            k = int(k)  # JSON (and OpenAI clients) send the token ids as strings
        if not is_int(k) or not 0 <= k <= INT64_MAX:
            raise bad("keys must be token ids: integers (or decimal strings) in [0, 2**63)")
        # The range check also refuses NaN and infinities (and needs no float conversion,
        # which overflows on a huge int).
        if (not isinstance(v, (int, float)) or isinstance(v, bool)
                or not -LOGIT_BIAS_MAX <= v <= LOGIT_BIAS_MAX):
            raise bad(f"values must be numbers in [-{LOGIT_BIAS_MAX:g}, {LOGIT_BIAS_MAX:g}]")
        if k in out:
            raise bad("two keys name the same token id")
        out[k] = float(v)
    return out
