"""The router's ``metrics`` answer: every replica's Prometheus text with a ``replica``
label on each sample (families merged, so each name is declared once, as the text format
requires), then the router's own counters."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from nvllm.router.policy import DECISIONS

if TYPE_CHECKING:
    from nvllm.router.server import Router

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?(\s.*)$")


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
    return "\n".join(lines) + "\n"
