"""Compiled grammars for structured output: compiled off the step loop, cached, and sent
once per grammar to rank 0 of each worker group.

Why here and not on rank 0: compiling is the expensive, failure-prone part (a bad schema
is the client's 400, a hostile one must not stall anything), so the leader does it once
per distinct spec, in a child process it can kill (nvllm/leader/grammar_compiler.py).
Rank 0 owns the per-sequence matchers: with async scheduling the leader builds plan N+1
before it sees plan N's token, while rank 0 has it in hand (docs/architecture.md).
"""

from __future__ import annotations

import collections
import json
import logging
import os
import queue
import select
import struct
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import msgpack

from nvllm.common import worker_protocol
from nvllm.common.errors import RequestRejected
from nvllm.common.structured_outputs import StructuredOutputsParams

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 120.0  # importing xgrammar and transformers, reading the tokenizer


class GrammarError(RequestRejected):
    """A spec that cannot be compiled (invalid, too big, or too slow): the request's
    ``invalid_request`` (400)."""


@dataclass(frozen=True, slots=True)
class CompiledGrammar:
    key: str
    data: str  # xgrammar's CompiledGrammar.serialize_json()

    @property
    def nbytes(self) -> int:
        return len(self.data)


class GrammarService:
    """Compiles specs in a child process, one at a time, each within ``timeout_s`` (the
    child is killed and restarted past it); keeps compiled grammars in an LRU cache
    bounded in bytes; identical specs in flight share one compile."""

    def __init__(self, tokenizer_path: str, vocab_size: int, stop_token_ids: list[int], *,
                 timeout_s: float, cache_bytes: int, max_spec_bytes: int,
                 any_whitespace: bool) -> None:
        self.spec = {"tokenizer": tokenizer_path, "vocab_size": vocab_size,
                     "stop_token_ids": list(stop_token_ids), "parent_pid": os.getpid()}
        self.timeout_s, self.cache_bytes = timeout_s, cache_bytes
        self.max_spec_bytes, self.any_whitespace = max_spec_bytes, any_whitespace
        self.tokenizer_info: str | None = None  # TokenizerInfo JSON, from the child
        self._cache: collections.OrderedDict[str, CompiledGrammar] = collections.OrderedDict()
        self._cached_bytes = 0
        self._pending: dict[str, Future] = {}
        self._lock = threading.Lock()
        self._jobs: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._proc: subprocess.Popen | None = None
        self._job_ids = iter(range(1, 1 << 62))
        self.num_compiled = self.num_hits = 0

    def key(self, so: StructuredOutputsParams) -> str:
        return so.key("any_ws" if self.any_whitespace else "compact")

    def check(self, so: StructuredOutputsParams) -> None:
        n = len(so.text.encode())
        if n > self.max_spec_bytes:
            raise GrammarError(f"structured_outputs.{so.kind} is {n} bytes, more than "
                               f"max_grammar_bytes {self.max_spec_bytes}")

    def get(self, so: StructuredOutputsParams) -> Future:
        """A future of the CompiledGrammar (done already on a cache hit); it fails with
        GrammarError for a spec that cannot be compiled."""
        self.check(so)
        key = self.key(so)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.num_hits += 1
                fut: Future = Future()
                fut.set_result(hit)
                return fut
            fut = self._pending.get(key)
            if fut is not None:
                return fut
            fut = self._pending[key] = Future()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="nvllm-grammar")
                self._thread.start()
        self._jobs.put((key, so))
        return fut

    def compile(self, so: StructuredOutputsParams) -> CompiledGrammar:
        """Blocking get (the offline API)."""
        return self.get(so).result()

    # ---- the compile thread ------------------------------------------------------------

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            key, so = job
            try:
                result: Any = self._compile(key, so)
            except Exception as e:  # noqa: BLE001 (each failure belongs to its request)
                result = e if isinstance(e, GrammarError) else GrammarError(
                    f"structured_outputs could not be compiled: {e}")
            with self._lock:
                fut = self._pending.pop(key)
                if isinstance(result, CompiledGrammar):
                    self._remember(result)
            if isinstance(result, CompiledGrammar):
                fut.set_result(result)
            else:
                fut.set_exception(result)

    def _remember(self, g: CompiledGrammar) -> None:
        self._cache[g.key] = g
        self._cached_bytes += g.nbytes
        while self._cached_bytes > self.cache_bytes:
            _, old = self._cache.popitem(last=False)
            self._cached_bytes -= old.nbytes

    def _compile(self, key: str, so: StructuredOutputsParams) -> CompiledGrammar:
        proc = self._ensure_process()
        job_id = next(self._job_ids)
        text = so.text
        frame = msgpack.packb([job_id, so.kind, text, self.any_whitespace], use_bin_type=True)
        try:
            proc.stdin.write(struct.pack("<I", len(frame)) + frame)
            proc.stdin.flush()
            reply = self._read(proc, time.monotonic() + self.timeout_s)
        except TimeoutError:
            self._kill()
            raise GrammarError(
                f"structured_outputs.{so.kind} took longer than {self.timeout_s:g} s to "
                "compile (grammar_compile_timeout_s); simplify it") from None
        except (OSError, EOFError) as e:
            self._kill()
            raise GrammarError(f"the grammar compiler failed ({e}); try again") from None
        rid, ok, payload, _ = reply
        if rid != job_id:
            self._kill()
            raise GrammarError("the grammar compiler answered out of turn; try again")
        if not ok:
            raise GrammarError(f"invalid structured_outputs.{so.kind}: {payload}")
        if len(payload) > self.cache_bytes:
            # It travels to rank 0 in one frame and must fit the cache that rank keeps.
            raise GrammarError(
                f"structured_outputs.{so.kind} compiles to {len(payload)} bytes, more than "
                f"the grammar cache ({self.cache_bytes} bytes, grammar_cache_mib); simplify it")
        self.num_compiled += 1
        return CompiledGrammar(key, payload)

    def _ensure_process(self) -> subprocess.Popen:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "nvllm.leader.grammar_compiler", json.dumps(self.spec)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=False)
        try:
            _, _, info, _ = self._read(self._proc, time.monotonic() + STARTUP_TIMEOUT_S)
        except (TimeoutError, OSError, EOFError) as e:
            self._kill()
            raise GrammarError(f"the grammar compiler did not start ({e or 'timeout'})"
                               ) from None
        self.tokenizer_info = info
        return self._proc

    @staticmethod
    def _read(proc: subprocess.Popen, deadline: float) -> Any:
        fd = proc.stdout.fileno()

        def exact(n: int) -> bytes:
            buf = b""
            while len(buf) < n:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([fd], [], [], left)[0]:
                    raise TimeoutError("timed out")
                chunk = os.read(fd, n - len(buf))
                if not chunk:
                    raise EOFError("the grammar compiler exited")
                buf += chunk
            return buf

        (n,) = struct.unpack("<I", exact(4))
        return msgpack.unpackb(exact(n), raw=False)

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        proc.kill()
        proc.wait()
        for f in (proc.stdin, proc.stdout):
            try:
                f.close()
            except OSError:
                pass

    def close(self) -> None:
        """Stop the compile thread and the child (their pending compiles fail)."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(timeout=1.0)
        self._kill()
        with self._lock:
            for fut in self._pending.values():
                if not fut.done():
                    fut.set_exception(GrammarError("the engine is shutting down"))
            self._pending.clear()

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid


class WorkerGrammars:
    """What rank 0 of the current worker group holds, so each grammar travels once per
    group: a ``LoadGrammars`` goes to rank 0 before the plan that first needs a grammar
    (the TokenizerInfo with the first one). Past ``budget_bytes`` the oldest grammars no
    live request uses are dropped there. A new worker group starts empty (``reset``)."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.reset()

    def reset(self) -> None:
        self.sent: collections.OrderedDict[str, int] = collections.OrderedDict()
        self.sent_bytes = 0
        self.info_sent = False

    def load_for(self, grammars: list[CompiledGrammar], tokenizer_info: str | None,
                 live_keys: Any) -> worker_protocol.LoadGrammars | None:
        """The message that makes rank 0 hold `grammars` (None: it holds them all).
        live_keys() gives the keys live requests use (only called to evict)."""
        new: dict[str, CompiledGrammar] = {}
        for g in grammars:
            if g.key in self.sent:
                self.sent.move_to_end(g.key)
            elif g.key not in new:
                new[g.key] = g
        if not new:
            return None
        for g in new.values():
            self.sent[g.key] = g.nbytes
            self.sent_bytes += g.nbytes
        drop = []
        if self.sent_bytes > self.budget_bytes:
            keep = set(live_keys()) | set(new)
            for key in list(self.sent):
                if self.sent_bytes <= self.budget_bytes:
                    break
                if key not in keep:
                    self.sent_bytes -= self.sent.pop(key)
                    drop.append(key)
        info = None if self.info_sent else tokenizer_info
        self.info_sent = True
        return worker_protocol.LoadGrammars(info, list(new), [g.data for g in new.values()],
                                            drop)
