"""The leader's client endpoint: a ZMQ ROUTER speaking msgpack maps.

This is the first cut of the client protocol (the serving issue extends it with
streaming, abort, TTL and priorities). Version 1 messages, client -> leader:

- ``{"v": 1, "op": "info"}``
- ``{"v": 1, "op": "generate", "id": ANY, "prompt": str}`` or ``"prompt_token_ids": [...]``,
  with optional ``"params": {SamplingParams fields}``

leader -> client: ``{"op": "info", ...}``, ``{"op": "output", "id", "token_ids", "text",
"finish_reason", "prompt_tokens"}`` once a request finishes, or ``{"op": "error", "id",
"code", "message"}``. Malformed frames get an error reply; nothing is ever unpickled.
"""

from __future__ import annotations

import itertools
import logging
import threading
from typing import Any

import msgpack
import zmq

from nvllm.common.errors import EngineDeadError, RequestRejected
from nvllm.common.sampling_params import SamplingParams
from nvllm.common.zmq_utils import make_socket
from nvllm.leader.engine import LLMEngine

logger = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
MAX_FRAME_BYTES = 64 << 20


class EngineServer:
    def __init__(self, engine: LLMEngine, host: str = "127.0.0.1", port: int = 0,
                 model_name: str | None = None) -> None:
        self.engine = engine
        self.model_name = model_name or engine.config.model
        self.ctx = zmq.Context()
        self.sock = make_socket(self.ctx, zmq.ROUTER, max_msg_bytes=MAX_FRAME_BYTES)
        if port:
            self.sock.bind(f"tcp://{host}:{port}")
        else:
            port = self.sock.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{host}:{port}"
        self._owners: dict[str, tuple[bytes, Any]] = {}  # request id -> (client, their id)
        self._ids = itertools.count()

    def _send(self, client: bytes, msg: dict) -> None:
        self.sock.send_multipart([client, msgpack.packb(msg, use_bin_type=True)])

    def _error(self, client: bytes, rid: Any, code: str, message: str) -> None:
        self._send(client, {"op": "error", "id": rid, "code": code, "message": message})

    def _handle(self, frames: list[bytes]) -> None:
        client, payload = frames[0], frames[-1]
        try:
            msg = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        except Exception as e:
            return self._error(client, None, "bad_frame", f"not a msgpack frame: {e}")
        if not isinstance(msg, dict):
            return self._error(client, None, "bad_frame", "a message must be a msgpack map")
        rid = msg.get("id")
        if msg.get("v", PROTOCOL_VERSION) != PROTOCOL_VERSION:
            return self._error(client, rid, "bad_version",
                               f"protocol version {msg.get('v')!r} is not {PROTOCOL_VERSION}")
        op = msg.get("op")
        if op == "info":
            e = self.engine
            return self._send(client, {
                "op": "info", "v": PROTOCOL_VERSION, "model": self.model_name,
                "max_model_len": e.config.max_model_len,
                "kv_capacity_tokens": e.capacity_tokens, "ready": True})
        if op != "generate":
            return self._error(client, rid, "bad_op", f"unknown op {op!r}")
        try:
            params = SamplingParams.from_dict(msg.get("params") or {})
            if not isinstance(rid, (str, int, type(None))):
                raise ValueError("id must be a string or an integer")
            prompt, ids = msg.get("prompt"), msg.get("prompt_token_ids")
            if (prompt is None) == (ids is None):
                raise ValueError("give exactly one of 'prompt' and 'prompt_token_ids'")
            if prompt is not None and not isinstance(prompt, str):
                raise ValueError("'prompt' must be a string")
            internal = f"srv-{next(self._ids)}"
            self.engine.add_request(prompt, params, request_id=internal, prompt_token_ids=ids)
        except (ValueError, TypeError) as e:  # RequestRejected is a ValueError
            code = "rejected" if isinstance(e, RequestRejected) else "invalid_request"
            return self._error(client, rid, code, str(e))
        self._owners[internal] = (client, rid)

    def serve(self, stop: threading.Event) -> None:
        """Admit and step until `stop` is set; idle waits block on the socket."""
        while not stop.is_set():
            timeout = 0 if self.engine.has_unfinished_requests() else 100
            while self.sock.poll(timeout):
                self._handle(self.sock.recv_multipart())
                timeout = 0
            if self.engine.has_unfinished_requests():
                try:
                    outs = self.engine.step()
                except EngineDeadError as e:
                    for client, rid in self._owners.values():
                        self._error(client, rid, "engine_unavailable", str(e).split("\n")[0])
                    self._owners.clear()
                    raise
                for out in outs:
                    client, rid = self._owners.pop(out.request_id)
                    self._send(client, {
                        "op": "output", "id": rid, "token_ids": out.token_ids,
                        "text": out.text, "finish_reason": out.finish_reason,
                        "prompt_tokens": len(out.prompt_token_ids)})

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()
