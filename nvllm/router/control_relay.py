"""The router's relay of the RL control messages (docs/rl.md) to every replica.

A trainer that attaches to the router instead of one leader pauses, resumes, sleeps,
wakes, updates and asks the state of the whole set: each such message goes to every
replica that is up, and the client gets one answer once all answered. Where one refused,
the answer is an error naming each replica that refused and why (the code of the first),
and saying which replicas did act, since their state now differs from the others'.

Shared-memory weight chunks are relayed too: every replica's workers read the same
segments (so the replicas must share the trainer's host; a remote replica refuses the
chunk, naming the segment). The process-group messages are not: a group has one world
size, and each replica's workers need their own ranks in it, so a trainer joins each
replica's leader directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from nvllm.router.replica import ReplicaLink

RELAYED_OPS = ("pause", "resume", "sleep", "wake_up", "state", "weights_from_path",
               "weights_chunk", "weights_commit", "weights_abort")
GROUP_OPS = ("init_weight_update_group", "weights_from_distributed")
GROUP_REFUSAL = ("the router does not relay {op}: a weight-update process group needs "
                 "ranks for each replica's workers; call init_weight_update_group and "
                 "update_weights_from_distributed on each replica's leader (its own "
                 "endpoint, docs/data-parallel.md), or update through the router from "
                 "shared memory or a checkpoint path")
_SUMMED = ("weights_bytes", "kv_cache_bytes", "device_bytes", "rss_bytes",
           "weights_missing")


@dataclass(slots=True)
class _Ask:
    client: bytes
    op: str
    waiting: set[int]
    answers: dict[int, dict[str, Any]] = field(default_factory=dict)


class ControlRelay:
    """The relayed control messages in flight: which replicas each still waits on."""

    def __init__(self) -> None:
        self.asks: list[_Ask] = []

    def start(self, client: bytes, msg: dict[str, Any], links: list[ReplicaLink]) -> bool:
        """Send `msg` to every up replica; False when none is up (nothing was sent)."""
        up = [lk for lk in links if lk.up]
        if not up:
            return False
        ask = _Ask(client, msg["op"], set())
        for lk in up:
            if lk.send(msg):
                lk.pending.append(ask.op)
                ask.waiting.add(lk.index)
            else:
                ask.answers[lk.index] = _error("engine_unavailable",
                                               "cannot take messages now")
        self.asks.append(ask)
        return True

    def answered(self, index: int, op: str, msg: dict[str, Any]) -> bool:
        """Record replica `index`'s answer to its oldest relayed `op`; False when none
        waits on it (a health or info answer, say)."""
        for ask in self.asks:
            if ask.op == op and index in ask.waiting:
                ask.waiting.discard(index)
                ask.answers[index] = msg
                return True
        return False

    def lost(self, index: int) -> None:
        """Replica `index`'s connection dropped: it will not answer."""
        for ask in self.asks:
            if index in ask.waiting:
                ask.waiting.discard(index)
                ask.answers[index] = _error("engine_unavailable", "its connection closed "
                                            "before it answered (the leader exited?)")

    def done(self) -> list[tuple[bytes, dict[str, Any]]]:
        """The asks every replica answered, each as (client, its one answer)."""
        out = [(a.client, merge(a.op, a.answers)) for a in self.asks if not a.waiting]
        self.asks = [a for a in self.asks if a.waiting]
        return out


def _error(code: str, message: str) -> dict[str, Any]:
    return {"op": "error", "id": None, "code": code, "message": message}


def merge(op: str, answers: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """The replicas' answers to one `op` as one: an error naming every replica that
    refused, else the first replica's answer with the sleep reports' byte counts summed
    and the states combined (paused only when all are, sleeping when any is; the
    weight_version when all agree, else None)."""
    ordered = [answers[i] for i in sorted(answers)]
    errors = {i: a for i, a in sorted(answers.items()) if a.get("op") != op}
    if errors:
        why = "; ".join(f"replica {i}: {str(a.get('message', a.get('op')))[:300]}"
                        for i, a in errors.items())
        acted = sorted(set(answers) - set(errors))
        if acted:
            why += f" (replicas {acted} did {op}: their state now differs)"
        first = next(iter(errors.values()))
        code = first.get("code") if first.get("op") == "error" else "internal_error"
        return _error(str(code), f"{op} through the router: {why}")
    out = dict(ordered[0])
    if op in ("sleep", "wake_up", "state"):
        for key in _SUMMED:
            if key in out:
                out[key] = sum(int(a.get(key) or 0) for a in ordered)
        out["asleep"] = sorted({t for a in ordered for t in a.get("asleep") or ()})
        out["level"] = max(int(a.get("level") or 0) for a in ordered)
    if op == "state":
        out["is_paused"] = all(a.get("is_paused") for a in ordered)
        out["is_sleeping"] = any(a.get("is_sleeping") for a in ordered)
        versions = {repr(a.get("weight_version")) for a in ordered}
        out["weight_version"] = out.get("weight_version") if len(versions) == 1 else None
    return out
