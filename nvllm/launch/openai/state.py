"""The gateway's configuration and shared state: one leader connection, the leader's info
(fetched once), the served model name, and the tokenizer (loaded on first use)."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from nvllm.common import trace
from nvllm.common.client import AsyncClient
from nvllm.launch.openai.errors import ApiError
from nvllm.launch.openai.schemas import MAX_BODY_BYTES
from nvllm.launch.openai.tokens import TokenText

CONTROL_TIMEOUT_S = 10.0  # info / metrics: the leader answers these between engine steps


@dataclass
class GatewayConfig:
    endpoint: str
    model_name: str | None = None
    api_key: str | None = None
    tokenizer: str | None = None  # default: the path in the leader's info()["model"]
    curve_key_dir: str | None = None  # CURVE keys for the leader connection
    max_body_bytes: int = MAX_BODY_BYTES  # bigger request bodies get 413
    trust_request_chat_template: bool = False  # a chat template from the request is code
    allow_priority: bool = False  # HTTP callers may set priority (and preempt others)
    tool_call_parser: str = "auto"  # tool_parsers.PARSER_CHOICES: how "auto" finds calls


class GatewayState:
    """What every route shares; ``client`` opens with the app (its lifespan)."""

    def __init__(self, cfg: GatewayConfig) -> None:
        self.cfg = cfg
        self.client: AsyncClient | None = None
        self.trace = trace.tracer("http")  # None unless $NVLLM_TRACE is set
        self._info: dict | None = None
        self._tokenizer: Any = None
        self._tokens: TokenText | None = None
        self._leader_tokenizes = True
        self._lock = asyncio.Lock()
        # Chat templates render here, off the event loop and apart from the default
        # executor (body parsing, tokenizer loading), so slow renders cannot stall those.
        self.render_pool = ThreadPoolExecutor(4, thread_name_prefix="nvllm-render")

    async def render(self, fn: Any, *args: Any) -> Any:
        """`fn(*args)` in the render pool."""
        return await asyncio.get_running_loop().run_in_executor(self.render_pool, fn, *args)

    async def info(self) -> dict:
        if self._info is None:
            try:
                info = await asyncio.wait_for(self.client.info(), CONTROL_TIMEOUT_S)
            except (asyncio.TimeoutError, TimeoutError):
                raise ApiError(503, f"the engine at {self.cfg.endpoint} does not answer",
                               code="engine_unavailable", type_="server_error") from None
            self._info = info
        return self._info

    async def served_name(self) -> str:
        return self.cfg.model_name or str((await self.info()).get("model"))

    async def check_model(self, name: str | None) -> None:
        if name is None:
            return
        info = await self.info()
        if name not in {await self.served_name(), str(info.get("model"))}:
            raise ApiError(404, f"the model '{name}' does not exist; this server serves "
                                f"'{await self.served_name()}'", param="model",
                           code="model_not_found")

    @property
    def leader_tokenizes(self) -> bool:
        """Whether /tokenize and /detokenize ask the leader, whose tokenizer is the
        model's: not when the gateway was given another (--tokenizer), nor once the
        leader refused (a data-parallel router does), when the gateway loads its own."""
        return self.cfg.tokenizer is None and self._leader_tokenizes

    def leader_refused_tokenize(self) -> None:
        self._leader_tokenizes = False

    async def tokenizer(self) -> Any:
        if self._tokenizer is None:
            async with self._lock:
                if self._tokenizer is None:
                    tok = await self._load_tokenizer()
                    self._tokens = TokenText(tok)
                    self._tokenizer = tok
        return self._tokenizer

    async def _load_tokenizer(self) -> Any:
        info = await self.info()
        path = self.cfg.tokenizer or str(info.get("model_path") or info["model"])

        def load() -> Any:
            # the tokenizers library alone where that is exact: no torch in the gateway
            from nvllm.common.tokenizer import open_tokenizer

            return open_tokenizer(path)

        try:
            return await asyncio.to_thread(load)
        except Exception as e:
            raise ApiError(500, f"cannot load the tokenizer from {path!r} (start "
                                f"nvllm-serve with --tokenizer): {e}",
                           type_="server_error") from e

    async def tokens(self) -> TokenText:
        await self.tokenizer()
        return self._tokens
