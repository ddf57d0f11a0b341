"""A ``Client`` that also speaks raw protocol maps, for tests that send what the typed
client never would (hand-built submits, frames with odd fields) and read replies as maps."""

from __future__ import annotations

from typing import Any

import msgpack

from nvllm.common import client_protocol as cp
from nvllm.common.client import Client

_KINDS = {"error": cp.Error, "info": cp.Info, "health": cp.Health, "metrics": cp.Metrics,
          "output": cp.Output}


class RawClient(Client):
    def send_map(self, msg: dict[str, Any]) -> None:
        self._send(msgpack.packb(msg, use_bin_type=True))

    def recv_map(self, deadline: float) -> dict[str, Any]:
        """The next message from the leader (pongs skipped), as its map."""
        return cp.to_map(self._recv(deadline))

    def wait_map(self, rid: str | None, ops: tuple[str, ...] = ()) -> dict[str, Any]:
        """The next message for request `rid`, or the next of `ops` about no request."""
        return cp.to_map(self._wait_for(rid, tuple(_KINDS[op] for op in ops)))
