"""Sleep and wake (vLLM's ``sleep(level)``, ``wake_up(tags)``, ``is_sleeping``): the
levels, the tags, and the memory report every path returns (``LLM``, ``Client``,
``AsyncClient``, the gateway's ``/sleep`` and ``/wake_up``).

Level 1 frees the KV cache and offloads the weights to host memory (on CUDA: pinned host
copies, device memory and CUDA graphs freed; on CPU the weights already are host memory
and stay where they are). Level 2 frees both: the weights' contents are gone, and the
engine generates nothing until ``update_weights`` has written every tensor of the
checkpoint again (docs/rl.md).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

SLEEP_LEVELS = (1, 2)
# How running requests end when generation pauses (pause_generation's, and sleep's first
# step): the values the wire and the gateway accept.
PAUSE_MODES = ("abort", "wait", "keep")
# What wake_up can restore: the weights, the KV cache, and scheduling (generation
# resumes). No tags: all three.
WAKE_TAGS = ("weights", "kv_cache", "scheduling")
MEMORY_TAGS = ("weights", "kv_cache")


def check_level(level: int) -> int:
    if isinstance(level, bool) or level not in SLEEP_LEVELS:
        raise ValueError(f"sleep level must be 1 (offload the weights to host memory, free "
                         f"the KV cache) or 2 (free both), got {level!r}")
    return level


def check_tags(tags: Iterable[str] | None) -> list[str]:
    """The tags to wake, in WAKE_TAGS order (None: all of them)."""
    if tags is None:
        return list(WAKE_TAGS)
    if isinstance(tags, str):
        tags = [tags]
    tags = list(tags)
    bad = [t for t in tags if t not in WAKE_TAGS]
    if bad or not tags:
        raise ValueError(f"wake_up tags must be some of {list(WAKE_TAGS)} (or none: all), "
                         f"got {tags!r}")
    return [t for t in WAKE_TAGS if t in tags]


@dataclass(slots=True)
class SleepReport:
    """What a sleep or wake_up did, from the engine's own accounting, summed over the
    ranks: `weights_bytes` and `kv_cache_bytes` freed (sleep) or allocated again (wake);
    `device_bytes` and `rss_bytes` what the ranks' devices and processes hold after it
    (CUDA's allocated bytes; the resident set, which on CPU lags the frees: see
    docs/rl.md). `asleep`: the memory still asleep; `weights_missing`: checkpoint
    tensors not yet written since a level-2 wake (generation waits for 0)."""

    level: int
    asleep: list[str] = field(default_factory=list)
    weights_bytes: int = 0
    kv_cache_bytes: int = 0
    device_bytes: int = 0
    rss_bytes: int = 0
    weights_missing: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
