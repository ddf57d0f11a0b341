"""Engine configuration and the model facts both sides derive from the checkpoint."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
DTYPES = ("float32", "bfloat16", "float16")
# Default KV-cache budget per worker on CPU (GiB), like vLLM's VLLM_CPU_KVCACHE_SPACE.
DEFAULT_CPU_KV_CACHE_GIB = 1.0


@dataclass(slots=True)
class ModelInfo:
    """What the leader and the workers need to know about a checkpoint."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    eos_token_ids: list[int]
    torch_dtype: str
    sliding_window: int | None = None

    @classmethod
    def from_pretrained(cls, model: str | os.PathLike) -> ModelInfo:
        path = Path(model)
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise FileNotFoundError(
                f"{path} has no config.json: point --model at a local HF-format checkpoint "
                "folder (nvllm does not download from a hub)"
            )
        cfg = json.loads(cfg_file.read_text())
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"architecture {archs} is not supported; supported: {SUPPORTED_ARCHITECTURES}"
            )
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        eos: Any = None
        gen_file = path / "generation_config.json"
        if gen_file.is_file():
            eos = json.loads(gen_file.read_text()).get("eos_token_id")
        if eos is None:
            eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        window = cfg.get("sliding_window")
        if cfg.get("use_sliding_window") is False:  # Qwen2 carries a window it does not use
            window = None
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            eos_token_ids=eos_ids,
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
            sliding_window=window,
        )


@dataclass(slots=True)
class EngineConfig:
    model: str
    tensor_parallel_size: int = 1
    device: str = "auto"  # "auto" | "cpu" | "cuda"
    dtype: str = "auto"  # "auto" (the checkpoint's) | float32 | bfloat16 | float16
    block_size: int = 16
    enable_prefix_caching: bool = True
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_gib: float = DEFAULT_CPU_KV_CACHE_GIB
    attention_backend: str = "auto"  # "auto" | "torch" | "triton"
    # CPU, torch backend: keep each running sequence's K/V also contiguous (within the
    # cpu_kv_cache_gib budget again), so attention stops re-gathering paged blocks.
    cpu_kv_mirror: bool = True
    # CPU, float32: linear weights packed in oneDNN's layout (faster at decode sizes).
    cpu_onednn_linear: bool = True
    # CPU: glibc malloc keeps freed memory mapped, so each step's activations reuse
    # pages instead of faulting in fresh ones (nvllm/worker/cpu_malloc.py).
    cpu_malloc_reuse: bool = True
    # Send plan N+1 before applying plan N's result, so the leader's work overlaps the
    # workers' (outputs are identical either way).
    async_scheduling: bool = True
    # Tensor parallel: split a step of at least micro_batch_min_tokens tokens into two
    # micro-batches, so one's all-reduce runs while the other computes.
    micro_batch_overlap: bool = True
    micro_batch_min_tokens: int = 256
    # CUDA: never capture decode steps as CUDA graphs (debugging, or to save the memory).
    enforce_eager: bool = False
    # Big plans' token ids and block tables through a shared-memory ring (every worker on
    # the leader's host), the plan carrying references; off: always msgpack lists.
    plan_shm: bool = True
    plan_shm_mib: int = 16
    seed: int = 0
    max_queued_requests: int | None = None  # beyond it, submissions are refused at once
    batch_timeout_ms: float = 0.0  # idle engine: wait this long for more arrivals
    client_timeout_s: float = 10.0  # a silent client's requests are aborted after this
    log_stats_interval_s: float = 5.0
    worker_start_timeout_s: float = 300.0
    step_timeout_s: float = 600.0  # watchdog: a step with no result by then is an error
    # Workers and leader ping each other; this much silence means the other side is gone.
    heartbeat_timeout_s: float = 4.0
    # On a worker failure, start a new worker group and recompute the in-flight requests
    # (at most this many times) instead of failing them.
    restart_workers: bool = False
    max_worker_restarts: int = 3
    model_info: ModelInfo | None = field(default=None, repr=False)

    def finalize(self) -> EngineConfig:
        """Validate, resolve "auto" values and read the checkpoint's facts."""
        self.model = str(Path(self.model).expanduser())
        info = self.model_info = ModelInfo.from_pretrained(self.model)
        tp = self.tensor_parallel_size
        if not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {tp}")
        if self.device == "auto":
            self.device = _detect_device()
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        if self.dtype == "auto":
            self.dtype = info.torch_dtype if info.torch_dtype in DTYPES else "float32"
            if self.device == "cpu" and self.dtype == "float16":
                self.dtype = "bfloat16"  # fp16 matmuls on CPU are slow and lossy
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {DTYPES}, got {self.dtype!r}")
        if info.num_attention_heads % tp:
            raise ValueError(
                f"num_attention_heads={info.num_attention_heads} is not divisible by "
                f"tensor_parallel_size={tp}"
            )
        kv = info.num_key_value_heads
        if (kv >= tp and kv % tp) or (kv < tp and tp % kv):
            raise ValueError(
                f"num_key_value_heads={kv} and tensor_parallel_size={tp}: one must divide "
                "the other"
            )
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_model_len is None:
            self.max_model_len = info.max_position_embeddings
            if info.sliding_window:
                self.max_model_len = min(self.max_model_len, info.sliding_window)
        if info.sliding_window and self.max_model_len > info.sliding_window:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the model's sliding_window "
                f"{info.sliding_window}; sliding-window attention is not supported, so use "
                f"max_model_len <= {info.sliding_window}")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.max_num_batched_tokens < self.max_num_seqs:
            # Each running sequence needs a token of budget per step to make progress.
            logger.info("max_num_seqs lowered from %d to max_num_batched_tokens=%d",
                        self.max_num_seqs, self.max_num_batched_tokens)
            self.max_num_seqs = self.max_num_batched_tokens
        if self.micro_batch_min_tokens < 1:
            raise ValueError(
                f"micro_batch_min_tokens must be >= 1, got {self.micro_batch_min_tokens}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.max_queued_requests is not None and self.max_queued_requests < 0:
            raise ValueError("max_queued_requests must be >= 0")
        if self.batch_timeout_ms < 0:
            raise ValueError("batch_timeout_ms must be >= 0")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(
                f"attention_backend must be auto, torch or triton, got {self.attention_backend!r}"
            )
        return self

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("model_info")
        return d


@dataclass(slots=True)
class DistConfig:
    """Where the workers of one engine run: this host only, or several nodes.

    One node (the default) rendezvous through a private FileStore: no port. Several nodes,
    or workers started by torchrun/SLURM (``leader_only``), rendezvous through a TCPStore
    at master_addr:master_port; the leader publishes its step-plan endpoints there.
    """

    nnodes: int = 1
    nproc_per_node: int | None = None  # workers per node (default: tp / nnodes)
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    leader_only: bool = False  # every worker is started elsewhere (torchrun, srun)
    curve_key_dir: str | None = None  # CURVE keys for the leader<->worker sockets

    @property
    def uses_store(self) -> bool:
        return self.nnodes > 1 or self.leader_only

    def local_ranks(self, tp: int) -> range:
        """Ranks this (leader) node starts itself."""
        if self.leader_only:
            return range(0)
        return range(self.per_node(tp))

    def per_node(self, tp: int) -> int:
        n = self.nproc_per_node or tp // self.nnodes
        if n < 1 or n * self.nnodes != tp:
            raise ValueError(
                f"--tp {tp} does not split into {self.nnodes} nodes of {n} workers: make tp "
                "a multiple of nnodes (or set --nproc-per-node so nnodes x nproc = tp)")
        return n

    def validate(self, tp: int) -> DistConfig:
        if self.nnodes < 1:
            raise ValueError(f"nnodes must be >= 1, got {self.nnodes}")
        if self.uses_store and not 0 < self.master_port < 65536:
            raise ValueError("several nodes need a rendezvous port: pass --master-port "
                             "(a free TCP port on the master node)")
        if not self.leader_only:
            self.per_node(tp)
        return self


def _detect_device() -> str:
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "cpu"
