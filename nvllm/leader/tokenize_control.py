"""``tokenize`` and ``detokenize`` from clients, by the engine's own tokenizer.

A front end that only forwards text (the OpenAI gateway's ``/tokenize`` and
``/detokenize``) asks here instead of loading a second copy of the tokenizer: for a
49k-token vocabulary that copy is ~30 MiB resident in the gateway process. The leader
already holds the tokenizer and a thread for long prompts (EngineServer.off_loop).

Short work is answered on the loop, as short submit prompts are tokenized there; long
texts and long id lists go to that thread and are answered by ``poll`` between steps, in
the order they finish. The fields were checked while decoding (sizes, ids inside the
vocabulary: nvllm/common/client_decode.py); what can still fail is the tokenizer itself,
answered as ``rejected`` for that message alone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from nvllm.common import client_protocol as cp

if TYPE_CHECKING:
    from nvllm.leader.server import EngineServer

logger = logging.getLogger(__name__)

MESSAGES = (cp.Tokenize, cp.Detokenize)
# Ids per character of text, about: detokenizing this many ids costs what tokenizing
# INLINE_TOKENIZE_CHARS characters does.
_CHARS_PER_ID = 4


def _tokenized(msg: cp.Tokenize) -> Callable[[Any], cp.Tokenized]:
    def work(tok: Any) -> cp.Tokenized:
        ids = list(tok(msg.prompt, add_special_tokens=msg.add_special_tokens)["input_ids"])
        strs = list(tok.convert_ids_to_tokens(ids)) if msg.return_token_strs else None
        return cp.Tokenized(msg.id, ids, strs)
    return work


def _detokenized(msg: cp.Detokenize) -> Callable[[Any], cp.Detokenized]:
    return lambda tok: cp.Detokenized(msg.id, tok.decode(msg.token_ids))


class TokenizeControl:
    """Answers tokenize / detokenize for one EngineServer (``handle``, then ``poll``)."""

    def __init__(self, server: EngineServer, inline_chars: int) -> None:
        self.server = server
        self.inline_chars = inline_chars
        self._pending: list[tuple[bytes, Any, Future]] = []  # client, its id, the work

    @property
    def pending(self) -> int:
        return len(self._pending)

    def handle(self, client: bytes, msg: cp.Tokenize | cp.Detokenize) -> None:
        tok = self.server.engine.tokenizer
        if tok is None:
            return self.server._error(client, msg.id, "rejected", "this engine has no "
                                      "tokenizer (started without one): tokenize on the "
                                      "client and send prompt_token_ids")
        if isinstance(msg, cp.Tokenize):
            work, size = _tokenized(msg), len(msg.prompt)
        else:
            work, size = _detokenized(msg), len(msg.token_ids) * _CHARS_PER_ID
        if size > self.inline_chars:
            self._pending.append((client, msg.id, self.server.off_loop(work)))
            return None
        try:
            answer = work(tok)
        except Exception as e:  # noqa: BLE001 (the tokenizer's own failure, this text's)
            return self._failed(client, msg.id, e)
        return self.server._send(client, answer)

    def poll(self) -> None:
        """Answer the off-loop work that finished."""
        if not self._pending:
            return
        still = []
        for client, rid, fut in self._pending:
            if not fut.done():
                still.append((client, rid, fut))
            elif fut.cancelled() or fut.exception() is not None:
                self._failed(client, rid, fut.exception())
            else:
                self.server._send(client, fut.result())
        self._pending = still

    def cancel_all(self, why: str) -> None:
        """Shutting down: every question still open gets its error."""
        for client, rid, fut in self._pending:
            fut.cancel()
            self.server._error(client, rid, "engine_unavailable", why)
        self._pending = []

    def _failed(self, client: bytes, rid: Any, e: BaseException | None) -> None:
        logger.info("tokenizer failed on a client's text: %r", e)
        self.server._error(client, rid, "rejected", "the tokenizer could not process this "
                                                    "input")
