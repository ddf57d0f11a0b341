"""Logprobs in OpenAI's two shapes: the legacy completions object (tokens, token_logprobs,
top_logprobs, text_offset) and the chat ``content`` list, from the leader's per-token
``{token_id: logprob}`` maps."""

from __future__ import annotations

from typing import Any

from nvllm.launch.openai.tokens import TokenText


def _lp_items(entry: Any) -> list[tuple[int, float]]:
    """One token's logprobs map (token id -> logprob; ids may arrive as strings) as pairs."""
    if not entry:
        return []
    items = entry.items() if isinstance(entry, dict) else entry
    return [(int(t), float(v)) for t, v in items]


def completion_logprobs(tokens: TokenText, token_ids: list[int], entries: list, top_n: int,
                        offset: int) -> tuple[dict, int]:
    """OpenAI legacy-completions logprobs for these tokens; returns (it, next text offset)."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                            "text_offset": []}
    for tid, entry in zip(token_ids, entries):
        items = _lp_items(entry)
        text = tokens(tid)[0]
        lp = dict(items).get(tid)
        top = sorted(items, key=lambda kv: -kv[1])[:top_n]
        if lp is not None and tid not in {t for t, _ in top}:
            top.append((tid, lp))  # the sampled token is always listed, like vLLM
            top.sort(key=lambda kv: -kv[1])
        out["tokens"].append(text)
        out["token_logprobs"].append(lp)
        shown: dict[str, float] = {}
        for t, v in top:  # best first: two ids with the same text keep the higher logprob
            shown.setdefault(tokens(t)[0], v)
        out["top_logprobs"].append(shown)
        out["text_offset"].append(offset)
        offset += len(text)
    return out, offset


def chat_logprobs(tokens: TokenText, token_ids: list[int], entries: list, top_n: int) -> dict:
    """OpenAI chat logprobs (``{"content": [...]}``) for these tokens."""
    content = []
    for tid, entry in zip(token_ids, entries):
        items = _lp_items(entry)
        text, raw = tokens(tid)
        lp = dict(items).get(tid)
        top = sorted(items, key=lambda kv: -kv[1])[:top_n]
        content.append({
            "token": text, "logprob": lp, "bytes": raw,
            "top_logprobs": [{"token": tokens(t)[0], "logprob": v, "bytes": tokens(t)[1]}
                             for t, v in top]})
    return {"content": content}
