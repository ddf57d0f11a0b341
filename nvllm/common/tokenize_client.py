"""tokenize and detokenize by the engine's tokenizer over the client wire: mixins of
``nvllm.Client`` and ``nvllm.AsyncClient`` (nvllm/common/client.py), whose ``_ask`` sends a
message with its own request id and returns the answer carrying it (an ``error`` raises).
The OpenAI gateway's /tokenize and /detokenize use these instead of a tokenizer of their
own (nvllm/leader/tokenize_control.py answers)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from nvllm.common import client_protocol as cp

if TYPE_CHECKING:
    from nvllm.common.client import AsyncClient, Client


def _tokenize_msg(rid: str, prompt: str, add_special_tokens: bool,
                  return_token_strs: bool) -> cp.Tokenize:
    return cp.Tokenize(id=rid, prompt=prompt, add_special_tokens=add_special_tokens,
                       return_token_strs=return_token_strs)


class TokenizeClient:
    def tokenize(self: Client, prompt: str, *, add_special_tokens: bool = True,
                 return_token_strs: bool = False) -> dict:
        """`prompt`'s ids by the engine's tokenizer: ``token_ids``, and ``token_strs`` when
        asked (the vocabulary's string of each)."""
        rid = self._new_id()
        return self._ask(_tokenize_msg(rid, prompt, add_special_tokens, return_token_strs))

    def detokenize(self: Client, token_ids: list[int]) -> str:
        """The text of `token_ids` by the engine's tokenizer."""
        return self._ask(cp.Detokenize(id=self._new_id(), token_ids=list(token_ids)))["text"]


class AsyncTokenizeClient:
    async def tokenize(self: AsyncClient, prompt: str, *, add_special_tokens: bool = True,
                       return_token_strs: bool = False) -> dict:
        """As Client.tokenize."""
        rid = self._new_id()
        return await self._ask(_tokenize_msg(rid, prompt, add_special_tokens,
                                             return_token_strs))

    async def detokenize(self: AsyncClient, token_ids: list[int]) -> str:
        """As Client.detokenize."""
        msg = cp.Detokenize(id=self._new_id(), token_ids=list(token_ids))
        return (await self._ask(msg))["text"]
