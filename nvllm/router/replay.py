"""What the router keeps of each request it forwards, so that a replica's loss does not
end it: the client's ``submit`` and what the client has been shown of the stream (its
token ids and the characters of its text). Replayed on another replica, the request
resumes from those (``Submit.output_token_ids`` / ``output_text_offset``,
docs/protocol.md): the leader there takes the tokens as already produced and streams only
what comes after, so the client sees no token or character twice and none missing.

A request is not replayed (its client gets one ``engine_unavailable`` error saying why)
when it asked for several completions (``n`` > 1: each has its own tokens, and those
already finished cannot be told to the leader), when it was replayed ``MAX_REPLAYS``
times already (a request that kills every replica it reaches must not take them all
down), or when no other replica is up.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

MAX_REPLAYS = 3


@dataclass(slots=True)
class Flight:
    """One client request on a replica, and what its client has seen of it."""

    client: bytes
    client_rid: Any
    replica: int
    remaining: int  # completions that have not sent their final message
    submit: dict[str, Any]  # the client's submit as sent on (under the router's id)
    arrival: float = field(default_factory=time.monotonic)
    token_ids: list[int] = field(default_factory=list)  # forwarded to the client so far
    text_chars: int = 0  # characters of text forwarded so far
    shown: bool = False  # a first output went out (it carried any prompt_logprobs)
    replays: int = 0
    aborted: bool = False  # the client asked to abort it
    # (replica, prompt tokens the prefix tree said it held) when routed by a tree; the
    # replica's answer says how many it had cached (nvllm/router/metrics.py).
    predicted: tuple[int, int] | None = None

    def forwarded(self, msg: dict[str, Any]) -> None:
        """Note an ``output`` message passed on to the client."""
        self.shown = True
        ids, text = msg.get("token_ids"), msg.get("text")
        if isinstance(ids, list):
            self.token_ids.extend(ids)
        if isinstance(text, str):
            self.text_chars += len(text)

    def why_not_replayable(self) -> str | None:
        """Why this request cannot be resumed elsewhere, or None when it can."""
        n = _params(self.submit).get("n", 1)
        if n != 1:
            return (f"it asked for n={n} completions; only single-completion requests are "
                    f"replayed")
        if self.replays >= MAX_REPLAYS:
            return f"it was replayed {self.replays} times already (the most a request is)"
        return None

    def resume_submit(self, new_id: int) -> dict[str, Any]:
        """The submit that resumes this request elsewhere under `new_id`: the client's,
        with the tokens and text it was shown as produced, prompt logprobs dropped once
        sent, and what is left of its ttl."""
        msg = dict(self.submit, id=new_id)
        if self.token_ids:
            msg["output_token_ids"] = list(self.token_ids)
            msg["output_text_offset"] = self.text_chars
        if self.shown and _params(self.submit).get("prompt_logprobs") is not None:
            msg["params"] = dict(_params(self.submit), prompt_logprobs=None)
        ttl = msg.get("ttl_ms")
        if isinstance(ttl, (int, float)) and not isinstance(ttl, bool):
            spent = (time.monotonic() - self.arrival) * 1000.0
            msg["ttl_ms"] = max(1.0, float(ttl) - spent)  # 1 ms: it times out at once
        return msg


def _params(submit: dict[str, Any]) -> dict[str, Any]:
    params = submit.get("params")
    return params if isinstance(params, dict) else {}
