"""A fake leader for gateway tests: a ZMQ ROUTER speaking docs/protocol.md."""

from __future__ import annotations


class FakeLeader:
    """A ZMQ ROUTER speaking docs/protocol.md: answers info/health/metrics/ping, records every
    submit and answers each of its n completions with one final output (length), or with
    `script`'s texts, one output each (the last one ends with stop), or with `error` (a
    (code, message) error answer)."""

    def __init__(self, model_path: str, curve_key_dir: str | None = None) -> None:
        import threading

        import zmq

        from nvllm.common.zmq_utils import curve_server

        self.model_path = model_path
        self.submits: list[dict] = []
        self.controls: list[dict] = []  # weights_from_path, init_weight_update_group
        self.ready = True  # health: False answers not ready, with a reason naming the path
        self.script: list[str] | None = None
        self.error: tuple[str, str] | None = None
        self.cached_tokens = 0  # each final output's usage.cached_tokens
        # tokenize / detokenize: answered with these ids (and "t<id>" strings) / this
        # text, or refused with bad_op as a data-parallel router refuses them.
        self.token_ids, self.text, self.refuse_tokenize = [7, 8, 9], "from the leader", False
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        # Keyed as the leader's client endpoint is: only DIR/clients/ keys get in.
        self.auth = None if curve_key_dir is None else \
            curve_server(self.ctx, self.sock, curve_key_dir)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        import msgpack

        def send(peer: bytes, msg: dict) -> None:
            self.sock.send_multipart([peer, msgpack.packb(msg, use_bin_type=True)])

        while not self.stop.is_set():
            if not self.sock.poll(50):
                continue
            peer, frame = self.sock.recv_multipart()
            msg = msgpack.unpackb(frame, raw=False, strict_map_key=False)
            op = msg.get("op")
            if op == "info":
                send(peer, {"op": "info", "v": 1, "model": "fake", "ready": True,
                            "model_path": self.model_path, "max_model_len": 1024,
                            "vocab_size": 1024, "kv_capacity_tokens": 4096, "block_size": 16,
                            "tensor_parallel_size": 1})
            elif op == "health":
                send(peer, {"op": "health", "ready": self.ready, "reason": None if self.ready
                            else f"engine failed loading {self.model_path}"})
            elif op == "metrics":
                send(peer, {"op": "metrics", "text": "fake_leader_up 1\n"})
            elif op == "ping":
                send(peer, {"op": "pong"})
            elif op in ("tokenize", "detokenize"):
                self.controls.append(msg)
                if self.refuse_tokenize:
                    send(peer, {"op": "error", "id": msg["id"], "code": "bad_op",
                                "message": f"the router does not answer {op}"})
                elif op == "tokenize":
                    send(peer, {"op": op, "id": msg["id"], "token_ids": self.token_ids,
                                "token_strs": [f"t{i}" for i in self.token_ids]
                                if msg.get("return_token_strs") else None})
                else:
                    send(peer, {"op": op, "id": msg["id"], "text": self.text})
            elif op in ("weights_from_path", "init_weight_update_group"):
                self.controls.append(msg)
                send(peer, {"op": "error", "id": None, "code": self.error[0],
                            "message": self.error[1]} if self.error is not None else
                     {"op": op, "weight_version": msg.get("weight_version") or 1})
            elif op == "submit":
                self.submits.append(msg)
                p = msg["params"]
                if self.error is not None:
                    send(peer, {"op": "error", "id": msg["id"], "code": self.error[0],
                                "message": self.error[1]})
                    continue
                if self.script is not None:
                    for index in range(int(p.get("n", 1))):
                        for j, text in enumerate(self.script):
                            last = j == len(self.script) - 1
                            send(peer, {"op": "output", "id": msg["id"], "index": index,
                                        "token_ids": [5], "text": text, "logprobs": None,
                                        "finish_reason": "stop" if last else None,
                                        "usage": {"prompt_tokens": 3,
                                                  "completion_tokens": len(self.script),
                                                  "cached_tokens": 0} if last else None})
                    continue
                lps = None if p.get("logprobs") is None else [{5: -0.5, 6: -1.5}]
                for index in range(int(p.get("n", 1))):
                    send(peer, {"op": "output", "id": msg["id"], "index": index,
                                "token_ids": [5], "text": "x", "logprobs": lps,
                                "finish_reason": "length",
                                "usage": {"prompt_tokens": 3, "completion_tokens": 1,
                                          "cached_tokens": self.cached_tokens}})

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
        assert not self.thread.is_alive()
        self.sock.close()
        if self.auth is not None:
            self.auth.stop()
        self.ctx.term()


class StallingLeader:
    """A leader that answers info and health, starts every request with one token and
    then holds it (recording submits and aborts; an abort gets the final message), and
    can close its socket at once, as a SIGKILLed leader's closes (`die`)."""

    def __init__(self) -> None:
        import threading

        import msgpack
        import zmq

        self.submits: list[dict] = []
        self.aborts: list = []
        self.muted = False  # reads, records and answers nothing (a stalled leader)
        self.controls: list[dict] = []  # the RL control messages (_control_answer)
        self.refuse: str | None = None  # each control message: a bad_state error saying it
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.started, self.stop = threading.Event(), threading.Event()
        answers = {"info": {"op": "info", "v": 1, "model": "m", "model_path": None,
                            "max_model_len": 1024, "vocab_size": 1024,
                            "kv_capacity_tokens": 1024, "block_size": 16,
                            "tensor_parallel_size": 1, "ready": True},
                   "health": {"op": "health", "ready": True},
                   "metrics": {"op": "metrics", "text": "# TYPE up gauge\nup 1.0\n"}}

        def output(rid, finish: str | None) -> dict:
            return {"op": "output", "id": rid, "index": 0, "token_ids": [5], "text": "x",
                    "logprobs": None, "finish_reason": finish}

        def serve() -> None:
            while not self.stop.is_set():
                if not self.sock.poll(20):
                    continue
                peer, frame = self.sock.recv_multipart()
                msg = msgpack.unpackb(frame)
                reply = answers.get(msg["op"])
                if msg["op"] == "submit":
                    self.submits.append(msg)
                    reply = output(msg["id"], None)
                    self.started.set()
                elif msg["op"] == "abort":
                    self.aborts.append(msg["id"])
                    reply = output(msg["id"], "abort")
                elif msg["op"] in _CONTROL_OPS:
                    self.controls.append(msg)
                    reply = _control_answer(msg, self.controls) if self.refuse is None else {
                        "op": "error", "id": None, "code": "bad_state",
                        "message": self.refuse}
                if reply is not None and not self.muted:
                    self.sock.send_multipart([peer, msgpack.packb(reply)])
            self.sock.close(0)
            self.ctx.term()

        self.thread = threading.Thread(target=serve, daemon=True)
        self.thread.start()

    def die(self) -> None:
        self.stop.set()
        self.thread.join(10)


_CONTROL_OPS = ("pause", "resume", "sleep", "wake_up", "state", "weights_from_path",
                "weights_chunk", "weights_commit", "weights_abort", "init_weight_update_group",
                "weights_from_distributed")


def _control_answer(msg: dict, seen: list[dict]) -> dict:
    """A leader's answer to an RL control message: a sleep report of 100 weight and 10
    KV bytes, a state paused after a pause, a commit with the version given (else 1)."""
    op = msg["op"]
    report = {"level": msg.get("level", 1), "asleep": ["kv_cache", "weights"],
              "weights_bytes": 100, "kv_cache_bytes": 10, "device_bytes": 0,
              "rss_bytes": 0, "weights_missing": 0}
    ops = [m["op"] for m in seen if m["op"] in ("pause", "resume")]
    return {"pause": {"op": op, "mode": msg.get("mode", "abort")},
            "sleep": {"op": op, **report}, "wake_up": {"op": op, **report, "asleep": []},
            "state": {"op": op, "is_sleeping": False, "is_paused": ops[-1:] == ["pause"],
                      "level": 0, "asleep": [], "weights_missing": 0,
                      "weight_version": None},
            "weights_chunk": {"op": op, "chunk": msg.get("chunk")},
            "weights_commit": {"op": op, "weight_version": msg.get("weight_version") or 1},
            "weights_from_path": {"op": op,
                                  "weight_version": msg.get("weight_version") or 1},
            }.get(op, {"op": op})
