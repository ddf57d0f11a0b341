"""Speculative decoding's configuration: vLLM's ``speculative_config`` interface.

``LLM(..., speculative_config={"method": "ngram", "num_speculative_tokens": 4,
"prompt_lookup_max": 4, "prompt_lookup_min": 2})`` and ``nvllm-launch
--speculative-config JSON`` both arrive here (``SpeculativeConfig.from_dict``): every key is
checked, an unknown one is an error, and an error names the field and its limit.

Methods. ``ngram`` (prompt lookup): the leader proposes, for each decoding sequence, the
tokens that followed the most recent earlier occurrence of its last n tokens
(nvllm/leader/ngram_proposer.py), the workers verify them in the step's forward and rank 0
accepts or rejects them (nvllm/worker/rejection_sampler.py). ``draft_model`` (a ``model``
key implies it, as in vLLM): rank 0 runs a small model with the target's vocabulary
(nvllm/worker/draft_runner.py, its KV in the target's blocks) and, after each step, k
greedy draft steps for every sequence that sampled; the drafts ride back in the step's
result (``StepResult.draft_token_ids``) and the leader's DraftModelProposer
(nvllm/leader/draft_proposer.py) puts them in the next plan where n-gram drafts go, so
verification, rollback and stop handling are shared. Greedy drafts are a point-mass q:
the rejection sampler then keeps the target's distribution exactly. The scheduler
reserves k lookahead slots per sampling sequence for the draft's KV (``_lookahead``).

Adding a method (EAGLE/MTP heads, suffix decoding): name it in ``METHODS``, give it a
proposer with the leader's interface (``eligible``, ``propose``, ``observe``, ``drop``;
nvllm/leader/draft_proposer.py is the model-based example) that returns up to k draft
tokens per decoding sequence (and, for a proposer with a distribution, its draft
probabilities: the rejection sampler already takes a general q, which would have to
travel with the drafts), and decide where it runs. A leader-side proposer (n-gram, suffix
decoding) plugs into ``Scheduler(proposer=...)`` as the n-gram one does; a model-based
one (draft model, EAGLE/MTP heads, which would read the target's hidden states on rank 0)
runs on rank 0 after the step, as the draft model does, and sends its drafts back with the
result; ``needs_lookahead`` makes the scheduler reserve slots for KV it writes ahead.

Async scheduling. The n-gram proposer on the leader needs each sequence's latest token
(the draft model's drafts come with it),
which under async scheduling is still in flight when the next plan is built; so while any
running sequence may propose, the engine runs synchronously (depth 0), as vLLM does for
its CPU n-gram proposer, and a plan with drafts is never left in flight. That costs the
leader/worker overlap (the leader's per-step work is then on the critical path): on the
2-core bench (scripts/bench_spec.py, SmolLM2-135M) synchronous steps alone cost ~5% at
concurrency 16. Where nothing may propose (every sequence paused for low acceptance, or
more sequences running than ``disable_by_batch_size``, or the batch size's measured
output rate higher without speculating: nvllm/leader/spec_gate.py), the engine goes back
to async scheduling (``async_scheduling`` permitting): ``Scheduler.speculating`` and
``SpecGate.allow``. Proposing on rank
0 (which has the token) would keep async scheduling always: a later option.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "draft_model")
IMPLEMENTED = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16
MAX_LOOKUP = 64  # longest n-gram matched


@dataclass(slots=True)
class SpeculativeConfig:
    """One engine's speculative decoding settings (vLLM's names and defaults where vLLM
    has the setting)."""

    method: str = "ngram"
    # k: the most draft tokens proposed per sequence and step (1..16).
    num_speculative_tokens: int = 4
    # n-gram lookup: match the sequence's last n tokens, n from prompt_lookup_max down to
    # prompt_lookup_min (vLLM: both default to 5; one given alone sets the other).
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    # Draft model (method draft_model): its checkpoint (an HF folder or a .gguf file), with
    # the target's vocabulary (EngineConfig.finalize checks it).
    model: str | None = None
    # Off (no sequence proposes) while more than this many sequences are running
    # (vLLM's knob, counted here over running sequences); None: never off.
    disable_by_batch_size: int | None = None
    # k falls with batch size: up to this many running sequences each propose k tokens;
    # beyond it each proposes max(1, k * full_k_batch_size // running).
    full_k_batch_size: int = 8
    # A sequence whose acceptance rate (an exponential moving average over its verify
    # steps, weight 0.3 on the newest) falls below this stops proposing ...
    min_acceptance_rate: float = 0.2
    # ... until it has generated this many more tokens, then tries again (0: never again).
    retry_after_tokens: int = 32
    # Measure output tokens per second with speculation on and off, per batch size
    # (running sequences, in powers of two), and speculate only where it is faster
    # (nvllm/leader/spec_gate.py); false: wherever the rules above allow.
    measure_throughput: bool = True
    # How many of a sequence's most recent tokens the n-gram lookup scans per step (its
    # cost per sequence is bounded by this, whatever the context length).
    lookup_window: int = 1024

    def __post_init__(self) -> None:
        self._check()

    @classmethod
    def from_dict(cls, d: Any) -> SpeculativeConfig:
        """The config from vLLM's dict form (or a JSON string of it, or a config already);
        ValueError naming the field and its limit for anything wrong."""
        if isinstance(d, SpeculativeConfig):
            return d
        if isinstance(d, str):
            try:
                d = json.loads(d)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(d, dict):
            raise ValueError("speculative_config must be a map of settings (e.g. "
                             '{"method": "ngram", "num_speculative_tokens": 4})')
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {unknown}; known: "
                             f"{sorted(names)}")
        d = dict(d)
        if d.get("method") is None:
            d["method"] = "draft_model" if d.get("model") is not None else "ngram"
        return cls(**d)

    def _check(self) -> None:
        def bad(name: str, limit: str) -> ValueError:
            return ValueError(f"speculative_config.{name} must be {limit}, got "
                              f"{getattr(self, name)!r}")

        def is_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        if self.method not in METHODS:
            raise bad("method", f"one of {list(METHODS)}")
        if self.method not in IMPLEMENTED:
            raise ValueError(f"speculative_config.method {self.method!r} is not supported "
                             f"yet (supported: {list(IMPLEMENTED)})")
        if self.method == "ngram" and self.model is not None:
            raise ValueError("speculative_config.model: method 'ngram' takes no model (a "
                             "model implies method 'draft_model')")
        if self.method == "draft_model" and (not isinstance(self.model, str)
                                             or not self.model):
            raise bad("model", "the draft model's checkpoint path (method 'draft_model')")
        k = self.num_speculative_tokens
        if not is_int(k) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise bad("num_speculative_tokens", f"an integer in 1..{MAX_SPECULATIVE_TOKENS}")
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            v = getattr(self, name)
            if v is not None and (not is_int(v) or not 1 <= v <= MAX_LOOKUP):
                raise bad(name, f"an integer in 1..{MAX_LOOKUP}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is None and hi is None:
            lo = hi = 5
        lo = hi if lo is None else lo
        hi = lo if hi is None else hi
        self.prompt_lookup_min, self.prompt_lookup_max = lo, hi
        if lo > hi:
            raise ValueError(f"speculative_config.prompt_lookup_min ({lo}) must be <= "
                             f"prompt_lookup_max ({hi})")
        b = self.disable_by_batch_size
        if b is not None and (not is_int(b) or b < 1):
            raise bad("disable_by_batch_size", "an integer >= 1 or null")
        if not is_int(self.full_k_batch_size) or self.full_k_batch_size < 1:
            raise bad("full_k_batch_size", "an integer >= 1")
        r = self.min_acceptance_rate
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0.0 <= r <= 1.0:
            raise bad("min_acceptance_rate", "a number in 0..1")
        if not is_int(self.retry_after_tokens) or self.retry_after_tokens < 0:
            raise bad("retry_after_tokens", "an integer >= 0")
        if not isinstance(self.measure_throughput, bool):
            raise bad("measure_throughput", "true or false")
        w = self.lookup_window
        if not is_int(w) or not hi + 1 <= w <= 1 << 20:
            raise bad("lookup_window", f"an integer in {hi + 1}..{1 << 20}")

    def k_for(self, num_running: int) -> int:
        """Draft tokens per sequence at this many running sequences (0: off)."""
        b = self.disable_by_batch_size
        if b is not None and num_running > b:
            return 0
        k = self.num_speculative_tokens
        if num_running <= self.full_k_batch_size:
            return k
        return max(1, k * self.full_k_batch_size // num_running)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def uses_draft_model(self) -> bool:
        return self.method == "draft_model"
