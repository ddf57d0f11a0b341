"""Token text for logprobs: each sampled or candidate token id as the text (and bytes) it
stands for, exact for byte-level BPE tokenizers (GPT-2's byte alphabet)."""

from __future__ import annotations

import contextlib
from typing import Any


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: byte -> the printable character a BPE token spells it
    with (transformers no longer exports it from one stable place)."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1))
          + list(range(ord("\xae"), ord("\xff") + 1)))
    cs = bs[:]
    extra = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return dict(zip(bs, map(chr, cs)))


class TokenText:
    """Token text for logprobs. Byte-level BPE tokens map back to their exact bytes (a token
    may hold part of a UTF-8 character); other tokenizers decode the single token.
    ``token_text(tid)`` is ``(text, its UTF-8 bytes as a list of ints)``."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}
        self._byte_decoder: dict[str, int] | None = None
        with contextlib.suppress(Exception):
            if type(tokenizer.backend_tokenizer.decoder).__name__ == "ByteLevel":
                self._byte_decoder = {c: b for b, c in bytes_to_unicode().items()}

    def __call__(self, tid: int) -> tuple[str, list[int]]:
        hit = self._cache.get(tid)
        if hit is not None:
            return hit
        piece = None
        with contextlib.suppress(Exception):
            piece = self.tok.convert_ids_to_tokens(int(tid))
        if piece is None:  # a model id the tokenizer has no token for
            out = ("", [])
        elif self._byte_decoder is not None and all(c in self._byte_decoder for c in piece):
            raw = bytes(self._byte_decoder[c] for c in piece)
            out = (raw.decode("utf-8", errors="replace"), list(raw))
        else:
            text = self.tok.decode([int(tid)], skip_special_tokens=False)
            out = (text, list(text.encode("utf-8")))
        self._cache[tid] = out
        return out
