"""Incremental detokenization with stop strings, one instance per completion.

Text is produced from a sliding window of token ids: a few prompt tokens of context (so
tokenizers that drop a leading space at the start of a decode still space the first
word right) and the tokens since the last emitted character. A window whose decode ends
in U+FFFD is an incomplete multi-byte character: nothing is emitted until it completes.
Stop strings are found in the whole text, and the last ``max(len(stop)) - 1``
characters are held back while generating, so a stream never shows part of a stop string.

Each new token costs two decodes, on the leader's step loop: they go straight to the
``tokenizers`` backend (``fast_decoder``), a quarter of the cost of the transformers
wrapper's ``decode`` around it.
"""

from __future__ import annotations

from collections.abc import Callable

CONTEXT_TOKENS = 5

Decode = Callable[[list[int], bool], str]  # (ids, skip_special_tokens) -> text


# transformers' generic fast-tokenizer modules, whose decode is the backend's text plus
# the optional clean-up (v4: tokenization_utils_fast; v5: tokenization_utils_tokenizers).
_GENERIC_DECODE = ("transformers.tokenization_utils_base", "transformers.tokenization_utils_fast",
                   "transformers.tokenization_utils_tokenizers")


def _decode_is_generic(tokenizer) -> bool:
    """Neither ``decode`` nor ``_decode`` is a model tokenizer's own override."""
    mro = type(tokenizer).__mro__
    for name in ("decode", "_decode"):
        owner = next((k for k in mro if name in vars(k)), None)
        if owner is None or owner.__module__ not in _GENERIC_DECODE:
            return False
    return True


def fast_decoder(tokenizer) -> Decode:
    """``tokenizer.decode``, through the ``tokenizers`` backend when the wrapper adds
    nothing to the backend's text (transformers' generic decode, without
    ``clean_up_tokenization_spaces``): the same text without the wrapper's per-call
    overhead. Any other tokenizer is called as it is."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if (backend is not None and hasattr(backend, "decode") and _decode_is_generic(tokenizer)
            and not getattr(tokenizer, "clean_up_tokenization_spaces", True)):
        return lambda ids, skip: backend.decode(ids, skip_special_tokens=skip)
    return lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip)


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], *, stop: list[str] | None = None,
                 include_stop_str_in_output: bool = False,
                 skip_special_tokens: bool = True, decode: Decode | None = None) -> None:
        """decode: the tokenizer's decode to use (the output processor shares one
        ``fast_decoder`` among its completions); default ``fast_decoder(tokenizer)``."""
        self.tokenizer = tokenizer
        self.decode = decode or (None if tokenizer is None else fast_decoder(tokenizer))
        ctx = list(prompt_token_ids[-CONTEXT_TOKENS:]) if tokenizer is not None else []
        self.ids: list[int] = ctx
        self.prefix_offset = 0
        self.read_offset = len(ctx)
        self.stop = [s for s in (stop or []) if s]
        self.include_stop = include_stop_str_in_output
        self.skip_special = skip_special_tokens
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""  # all output text so far (cut at a stop string once found)
        self.sent = 0  # characters of text already handed out

    def _decode(self, ids: list[int]) -> str:
        return self.decode(ids, self.skip_special)

    def add(self, token_ids: list[int], finished: bool = False) -> tuple[str, bool]:
        """Feed new tokens; returns (text delta to emit, True if a stop string was hit)."""
        if self.tokenizer is None:
            return "", False
        start = len(self.text)
        for t in token_ids:
            self.ids.append(t)
            prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
            full = self._decode(self.ids[self.prefix_offset:])
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                self.text += full[len(prefix):]
                self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        if finished and self.read_offset < len(self.ids):  # flush an incomplete character
            prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
            self.text += self._decode(self.ids[self.prefix_offset:])[len(prefix):]
            self.read_offset = len(self.ids)
        hit = self._find_stop(start)
        emit_to = len(self.text) if (finished or hit) else max(self.sent,
                                                              len(self.text) - self.holdback)
        delta = self.text[self.sent:emit_to]
        self.sent = emit_to
        return delta, hit

    def _find_stop(self, start: int) -> bool:
        if not self.stop:
            return False
        best = None
        for s in self.stop:
            i = self.text.find(s, max(0, start - len(s) + 1))
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return False
        i, s = best
        self.text = self.text[:i + len(s) if self.include_stop else i]
        self.sent = min(self.sent, len(self.text))
        return True

    def flush(self) -> str:
        """Everything not yet emitted (the held-back tail, at the end of a completion)."""
        delta = self.text[self.sent:]
        self.sent = len(self.text)
        return delta
