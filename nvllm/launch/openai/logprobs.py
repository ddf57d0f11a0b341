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


def prompt_completion_logprobs(tokens: TokenText, token_ids: list[int], entries: list,
                               top_n: int) -> tuple[dict, int]:
    """The legacy logprobs object of an echoed prompt (entries: the leader's
    prompt_logprobs), as vLLM gives it: the first token's logprob and top entry are null."""
    out, offset = completion_logprobs(tokens, token_ids, entries, top_n, 0)
    for i, entry in enumerate(entries):
        if entry is None:
            out["top_logprobs"][i] = None
    return out, offset


def vllm_prompt_logprobs(tokens: TokenText, token_ids: list[int], entries: list,
                         top_n: int) -> list:
    """vLLM's ``prompt_logprobs`` field: per prompt token null (the first) or
    ``{token id: {logprob, rank, decoded_token}}``. Ranks are known for the top-k (1..k);
    a prompt token outside them (the map's k+1-th entry) has rank null: the leader sends
    its logprob, not its rank."""
    out: list = []
    for tid, entry in zip(token_ids, entries):
        if entry is None:
            out.append(None)
            continue
        items = sorted(_lp_items(entry), key=lambda kv: -kv[1])
        outside = len(items) > top_n  # the prompt token is not among the top-k
        ranked = [kv for kv in items if not (outside and kv[0] == tid)]
        shown = {str(t): {"logprob": v, "rank": r + 1, "decoded_token": tokens(t)[0]}
                 for r, (t, v) in enumerate(ranked)}
        if outside:
            v = dict(items)[tid]
            shown = {str(tid): {"logprob": v, "rank": None, "decoded_token": tokens(tid)[0]},
                     **shown}
        out.append(shown)
    return out


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
