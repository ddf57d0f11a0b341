"""``build_engine``: the one way an engine is put together, for ``LLM`` and ``nvllm-launch``.

It wires what the leader package may not import itself: the worker-group launcher
(nvllm/launch/spawn.py), the shared-memory plan ring, and the tokenizer.
"""

from __future__ import annotations

import logging

from nvllm.common.config import DistConfig, EngineConfig
from nvllm.common.tokenizer import open_tokenizer
from nvllm.common.transport import ArrayWriter, TransportError
from nvllm.launch.spawn import start_worker_group
from nvllm.leader.engine import LLMEngine
from nvllm.leader.executor import Executor
from nvllm.worker.cpu_malloc import release_freed_memory

logger = logging.getLogger(__name__)


def build_engine(config: EngineConfig, dist: DistConfig | None = None, *,
                 serving: bool = False) -> LLMEngine:
    """Start the workers `config` describes (placed as `dist` says; default: all on this
    host), wait until their KV cache is allocated, and return the engine driving them.
    The caller owns it: ``engine.shutdown()`` stops the workers.

    `serving`: the process only serves clients (``nvllm-launch``'s server, a data-parallel
    replica), so it needs the tokenizer to encode and decode alone, and takes
    ``open_tokenizer``'s (no torch in the leader where the folder allows); otherwise
    (``LLM``, the demo) transformers' AutoTokenizer, whose chat templates and API a
    caller of ``LLM.get_tokenizer`` expects."""
    dist = dist or DistConfig()
    if config.model_info is None:
        config.finalize()
    if config.restart_workers and dist.uses_store:
        raise ValueError("restart_workers needs every worker on this node: workers on "
                         "other nodes are restarted by their own launcher, not the leader")
    tokenizer = (None if config.skip_tokenizer_init
                 else open_tokenizer(config.source.tokenizer, light=serving))
    plan_writer = None
    if config.plan_shm and not dist.uses_store:  # every rank is local
        try:
            plan_writer = ArrayWriter(capacity_bytes=config.plan_shm_mib << 20,
                                      timeout_s=0.0)
        except TransportError as e:
            logger.warning("plans travel as lists: %s", e)
    try:
        executor = Executor(config, lambda: start_worker_group(config, dist), plan_writer)
    except BaseException:
        if plan_writer is not None:
            plan_writer.close()
        raise
    try:
        engine = LLMEngine(config, executor, tokenizer)
    except BaseException:
        executor.shutdown()
        raise
    # What the model's metadata, tokenizer and worker start freed stays in the leader's
    # heap below glibc's dynamic trim threshold (~28 MiB with SmolLM2-135M's GGUF).
    release_freed_memory()
    return engine
