"""The router's ``metrics`` answer: every replica's Prometheus text with a ``replica``
label on each sample (families merged, so each name is declared once, as the text format
requires), then the router's own counters."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from nvllm.router.policy import DECISIONS

if TYPE_CHECKING:
    from nvllm.router.server import Router

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?(\s.*)$")


@dataclass(slots=True)
class PrefixAccuracy:
    """How far the approximate prefix tree's word is from each replica's own: per replica,
    the prompt tokens the tree predicted it held for the requests routed there, and those
    the replica's answer says it had cached (``usage.cached_tokens``), with the requests
    whose prediction was off by more than one KV block either way. The tree overestimates
    when the replica evicted what the tree still holds; exact KV events (vLLM's) could
    fix only those requests, so this bounds what they would gain."""

    predicted: Counter[int] = field(default_factory=Counter)
    cached: Counter[int] = field(default_factory=Counter)
    requests: Counter[int] = field(default_factory=Counter)
    over: Counter[int] = field(default_factory=Counter)
    under: Counter[int] = field(default_factory=Counter)

    def answered(self, replica: int, predicted: int, usage: Any, block_size: int) -> None:
        """One request's final answer from `replica` (its ``usage``, if any)."""
        cached = usage.get("cached_tokens") if isinstance(usage, dict) else None
        if type(cached) is not int:
            return  # a replica that does not report it says nothing about the tree
        self.requests[replica] += 1
        self.predicted[replica] += predicted
        self.cached[replica] += cached
        if predicted - cached > block_size:
            self.over[replica] += 1
        elif cached - predicted > block_size:
            self.under[replica] += 1

    def exposition(self, replicas: list[int]) -> list[str]:
        out = []
        for name, counter, what in (
                ("prefix_predicted_tokens", self.predicted, "Prompt tokens the prefix tree "
                 "predicted the replica held, summed over the requests routed there."),
                ("prefix_cached_tokens", self.cached, "Prompt tokens the replica reported "
                 "cached (usage.cached_tokens) for those requests."),
                ("prefix_predictions", self.requests, "Requests whose prediction was "
                 "checked against the replica's answer."),
                ("prefix_overestimated", self.over, "Requests whose predicted match "
                 "exceeded the replica's cached tokens by more than one KV block."),
                ("prefix_underestimated", self.under, "Requests whose replica cached more "
                 "than one KV block beyond the predicted match.")):
            fam = f"nvllm_router:{name}_total"
            out += [f"# HELP {fam} {what}", f"# TYPE {fam} counter"]
            out += [f'{fam}{{replica="{r}"}} {float(counter.get(r, 0))}' for r in replicas]
        return out


def _labelled(line: str, replica: int) -> str:
    m = _SAMPLE.match(line)
    if m is None:
        return line
    name, labels, rest = m.groups()
    if labels and labels != "{}":
        return f'{name}{{replica="{replica}",{labels[1:]}{rest}'
    return f'{name}{{replica="{replica}"}}{rest}'


def merge_expositions(texts: dict[int, str]) -> str:
    """Replica index -> its exposition, as one exposition: each family's HELP and TYPE
    once, then its samples from every replica, labelled."""
    headers: dict[str, list[str]] = {}  # family -> its # lines (first replica's)
    samples: dict[str, list[str]] = {}
    for replica in sorted(texts):
        family = ""
        for line in texts[replica].splitlines():
            if not line.strip():
                continue
            if line.startswith("#"):
                parts = line.split(None, 3)
                if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                    family = parts[2]
                    if family not in samples:
                        headers.setdefault(family, []).append(line)
                continue
            samples.setdefault(family, []).append(_labelled(line, replica))
        for fam in headers:
            samples.setdefault(fam, [])
    out = []
    for family, lines in samples.items():
        out.extend(headers.get(family, []))
        out.extend(lines)
    return "\n".join(out) + ("\n" if out else "")


def router_exposition(router: Router) -> str:
    """The router's own families: requests routed per decision, each replica's in-flight
    count and share of the prefix tree, requests replayed after a replica's loss and those
    that could not be."""
    lines = ["# HELP nvllm_router:requests_routed_total Requests routed, by the policy's "
             "reason.", "# TYPE nvllm_router:requests_routed_total counter"]
    policy = router.policy.name
    lines += [f'nvllm_router:requests_routed_total{{policy="{policy}",decision="{d}"}} '
              f"{float(router.decisions.get(d, 0))}" for d in DECISIONS]
    lines += ["# HELP nvllm_router:requests_in_flight Requests the router has in flight on "
              "each replica.", "# TYPE nvllm_router:requests_in_flight gauge"]
    lines += [f'nvllm_router:requests_in_flight{{replica="{lk.index}"}} {float(lk.load)}'
              for lk in router.links]
    lines += ["# HELP nvllm_router:replica_up Whether the replica takes new requests.",
              "# TYPE nvllm_router:replica_up gauge"]
    lines += [f'nvllm_router:replica_up{{replica="{lk.index}"}} {float(lk.up)}'
              for lk in router.links]
    tree = getattr(router.policy, "tree", None)
    if tree is not None:
        lines += ["# HELP nvllm_router:prefix_tree_tokens Prompt tokens the cache-aware "
                  "tree holds for each replica.", "# TYPE nvllm_router:prefix_tree_tokens gauge"]
        lines += [f'nvllm_router:prefix_tree_tokens{{replica="{lk.index}"}} '
                  f"{float(tree.size.get(lk.index, 0))}" for lk in router.links]
    lines += ["# HELP nvllm_router:requests_replayed_total Requests resumed on another "
              "replica after theirs (the label) went away.",
              "# TYPE nvllm_router:requests_replayed_total counter"]
    lines += [f'nvllm_router:requests_replayed_total{{replica="{lk.index}"}} '
              f"{float(router.replayed.get(lk.index, 0))}" for lk in router.links]
    lines += ["# HELP nvllm_router:requests_failed_replica_lost_total Requests ended with an "
              "error because their replica (the label) went away and they could not be "
              "replayed.", "# TYPE nvllm_router:requests_failed_replica_lost_total counter"]
    lines += [f'nvllm_router:requests_failed_replica_lost_total{{replica="{lk.index}"}} '
              f"{float(router.failed_by_replica_loss.get(lk.index, 0))}"
              for lk in router.links]
    if tree is not None:
        lines += router.prefix_accuracy.exposition([lk.index for lk in router.links])
    return "\n".join(lines) + "\n"
