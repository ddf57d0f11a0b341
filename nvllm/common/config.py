"""Engine configuration and the model facts both sides derive from the checkpoint."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from nvllm.common.model_source import ModelSource, resolve_model_source

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
)
DTYPES = ("float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", *DTYPES)
DEVICES = ("auto", "cpu", "cuda")
ATTENTION_BACKENDS = ("auto", "torch", "triton", "cpu")
QUANTIZATIONS = ("auto", "none", "int8", "int4", "fp8")  # nvllm/worker/quantize.py
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
    num_experts: int = 0  # MoE models: routed experts per MoE layer (0: dense)
    expert_intermediate_size: int = 0  # MoE models: each expert's intermediate size
    # Each layer's sliding window (None: full attention), as HF applies it.
    layer_windows: list[int | None] = field(default_factory=list)

    @property
    def kv_window(self) -> int | None:
        """The window outside of which no layer reads a key: the largest one when every
        layer slides, else None (a full-attention layer reads every key). Blocks behind it
        can go back to the pool (nvllm/leader/kv_cache_manager.py)."""
        w = self.layer_windows
        return max(w) if w and all(w) else None  # type: ignore[type-var]

    @classmethod
    def from_pretrained(cls, model: str | os.PathLike) -> ModelInfo:
        path = Path(model)
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise FileNotFoundError(
                f"{path} has no config.json: point --model at a local HF-format checkpoint "
                "folder or a .gguf file (nvllm does not download from a hub)"
            )
        cfg = json.loads(cfg_file.read_text())
        archs = cfg.get("architectures") or []
        if not archs and cfg.get("model_type"):  # as transformers' Auto classes do
            from nvllm.common.model_source import causal_lm_architecture

            archs = [a for a in [causal_lm_architecture(cfg["model_type"])] if a]
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
            num_experts=int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0),
            expert_intermediate_size=int(cfg.get("moe_intermediate_size")
                                         or cfg.get("intermediate_size") or 0),
            layer_windows=layer_windows(arch, cfg),
        )


def layer_windows(arch: str, cfg: dict[str, Any]) -> list[int | None]:
    """Each layer's sliding window (None: full attention) from an HF config.json, as
    transformers 5 applies it: Llama never slides; Mistral and Mixtral slide every layer
    by ``sliding_window`` (they ignore ``layer_types``), Qwen3-MoE too but only with
    ``use_sliding_window``; Qwen2/Qwen3 only with
    ``use_sliding_window`` (default False), on the layers ``layer_types`` calls
    "sliding_attention", which default to those from ``max_window_layers`` (default 28)
    on."""
    n = cfg["num_hidden_layers"]
    w = cfg.get("sliding_window")
    if arch in ("MistralForCausalLM", "MixtralForCausalLM"):
        return [w] * n
    if arch == "Qwen3MoeForCausalLM":  # every layer, with use_sliding_window
        return [w if cfg.get("use_sliding_window") else None] * n
    if arch not in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") or not cfg.get("use_sliding_window"):
        return [None] * n
    types = cfg.get("layer_types") or [
        "sliding_attention" if w is not None and i >= cfg.get("max_window_layers", 28)
        else "full_attention" for i in range(n)]
    return [w if t == "sliding_attention" else None for t in types]


def _setting(default: Any, help: str, **cli: Any) -> Any:
    """An EngineConfig field whose default and help are written once, here.

    The command lines (nvllm/launch/options.py) make one option per field from this
    metadata, so a default changed here changes every entry point. ``cli`` may hold
    ``flags`` (the option's names, in help order; the field's own ``--field-name`` is
    added when missing) and ``choices``.
    """
    return field(default=default, metadata={"help": help, **cli})


@dataclass(slots=True)
class EngineConfig:
    """Every engine setting; the keyword arguments of ``LLM(...)`` and the engine flags of
    ``nvllm-launch`` are these fields, one to one."""

    model: str
    tokenizer: str | None = _setting(
        None, "Tokenizer folder (default: the checkpoint's; for a .gguf file, its own "
              "metadata's).")
    tensor_parallel_size: int = _setting(
        1, "Number of tensor-parallel worker processes.",
        flags=("--tp", "--tensor-parallel-size"))
    device: str = _setting(
        "auto", "Where the workers run; auto: CUDA when available.", choices=DEVICES)
    dtype: str = _setting(
        "auto", "Weights and activations; auto: the checkpoint's (float16 becomes bfloat16 "
                "on CPU).", choices=("auto", *DTYPES))
    kv_cache_dtype: str = _setting(
        "auto", "What the KV cache holds; auto: the run dtype. bfloat16 under a float32 run "
                "(CPU) halves the cache's bytes: keys and values are rounded once, when "
                "stored, and attention still computes in float32.",
        choices=KV_CACHE_DTYPES)
    block_size: int = _setting(16, "Tokens per KV block.")
    enable_prefix_caching: bool = _setting(
        True, "Reuse the KV blocks of a prompt prefix seen before.")
    max_num_seqs: int = _setting(256, "Most sequences running in one step.")
    max_num_batched_tokens: int = _setting(2048, "Most tokens (prefill + decode) in one step.")
    max_model_len: int | None = _setting(
        None, "Longest prompt + output (default: the model's max_position_embeddings).")
    num_kv_blocks: int | None = _setting(
        None, "Override the KV capacity computed from memory.")
    gpu_memory_utilization: float = _setting(
        0.9, "CUDA: share of the GPU's memory the worker may use (weights + KV cache).")
    cpu_kv_cache_gib: float = _setting(
        DEFAULT_CPU_KV_CACHE_GIB, "KV-cache budget per worker on CPU, in GiB.")
    attention_backend: str = _setting(
        "auto", "Kernels: torch (reference), triton, or cpu (nvllm's native CPU ops, built "
                "per machine); auto: triton on CUDA (with triton installed), on CPU cpu "
                "where the native ops build, else torch.",
        choices=ATTENTION_BACKENDS)
    quantization: str = _setting(
        "auto", "Weights held quantized (docs/quantization.md): auto keeps a packed "
                "checkpoint's own format (a GGUF file's blocks, K-quants nearly; AWQ / "
                "GPTQ 4-bit; an fp8 checkpoint's e4m3 weights; a float checkpoint loads as "
                "none); none dequantizes every weight to the run dtype; int8/int4 quantize "
                "the linear layers and MoE experts at load (round-to-nearest per group of "
                "32, with a scale and a min per group); fp8 quantizes them to e4m3 with "
                "one scale per output channel (as vLLM's fp8); embeddings and the LM head "
                "stay in the run dtype (a tied head shares the embedding's copy).",
        choices=QUANTIZATIONS)
    cpu_kv_mirror: bool = _setting(
        True, "CPU, torch/cpu backends: keep each running sequence's K/V also contiguous (within "
              "the cpu_kv_cache_gib budget again), so attention stops re-gathering paged "
              "blocks; off, the cpu backend's decode kernel reads the pages in place and "
              "only prompt runs gather them (the KV cache is then held once).")
    cpu_onednn_linear: bool = _setting(
        True, "CPU, float32: linear weights packed in oneDNN's layout (faster at decode "
              "sizes).")
    cpu_threads: int = _setting(
        0, "CPU: torch threads per worker (0: the machine's cores divided among the "
           "workers on it).")
    cpu_thread_tuning: bool = _setting(
        True, "CPU, tp=1: run each step on cpu_threads threads or on one, whichever its "
              "size class measures faster now (on cores shared with other processes one "
              "thread can be several times faster; on free cores more threads win). Outputs "
              "are the same either way.")
    cpu_pin_workers: bool = _setting(
        False, "CPU: pin each worker to its own cores (local rank i to the i-th cpu_threads "
               "of the cores it may run on; skipped when there are too few), as vLLM pins its "
               "worker thread.")
    cpu_malloc_reuse: bool = _setting(
        True, "CPU: glibc malloc keeps freed memory mapped, so each step's activations "
              "reuse pages instead of faulting in fresh ones.")
    page_out_libraries: bool = _setting(
        True, "Once warm, the leader, the workers and the HTTP gateway give back the "
              "shared-library pages their start-up touched (madvise MADV_PAGEOUT; ~70 MiB "
              "of torch's in a CPU worker); the pages steps use fault back in. "
              "nvllm/common/pageout.py.")
    async_scheduling: bool = _setting(
        True, "Send step N+1's plan before applying step N's result, so the leader's work "
              "overlaps the workers' (outputs are identical either way).")
    speculative_config: Any = _setting(
        None, "Speculative decoding, as vLLM's speculative_config: a map (LLM) or its JSON "
              "(the flag), e.g. {\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
              "\"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2}, or a draft model: "
              "{\"model\": PATH, \"num_speculative_tokens\": 4} (same vocabulary as the "
              "target). Keys and defaults: nvllm/common/speculative.py. Steps in which a "
              "sequence may propose drafts run synchronously (no async scheduling), as vLLM "
              "does for its n-gram proposer.", json=True)
    enable_expert_parallel: bool = _setting(
        False, "MoE models: each rank holds whole experts (contiguous ranges, uneven when "
               "tensor_parallel_size does not divide their number) instead of a share "
               "of every expert; attention stays tensor-parallel. Ignored by dense models.")
    micro_batch_overlap: bool = _setting(
        True, "Tensor parallel: cut big steps into two micro-batches so one's all-reduce runs "
              "while the other computes.")
    micro_batch_min_tokens: int = _setting(
        256, "Smallest step (in tokens) that is cut into micro-batches.")
    cpu_shm_allreduce: bool = _setting(
        True, "CPU, tensor parallel with every rank on one host (x86): all-reduces, the "
              "sampled tokens' broadcast and the logits' gather of up to 4 MiB per rank (less "
              "beyond 4 ranks: 32 MiB in all) go through a shared-memory segment instead of "
              "gloo (larger ones, and ranks on several hosts, stay on gloo).")
    enforce_eager: bool = _setting(
        False, "CUDA: run decode steps eagerly instead of replaying CUDA graphs (debugging, "
               "or to save their memory).")
    plan_shm: bool = _setting(
        True, "Big plans' token ids and block tables through a shared-memory ring (when "
              "every worker is on this host) instead of msgpack lists.")
    plan_shm_mib: int = _setting(16, "Size of the plan_shm ring, in MiB.")
    seed: int = _setting(0, "Seeds sampling (and torch) in the workers.")
    skip_tokenizer_init: bool = _setting(
        False, "Load no tokenizer: prompts must be token ids, outputs carry no text.")
    max_queued_requests: int | None = _setting(
        4096, "Refuse new requests with 'overloaded' beyond this many waiting.")
    # What one client request may carry (nvllm/common/client_limits.py builds the limits).
    max_request_id_bytes: int = _setting(256, "Longest client request id, in bytes.")
    max_prompt_bytes: int | None = _setting(
        None, "Longest text prompt, in UTF-8 bytes, checked before tokenizing (default: "
              "32 bytes per token of max_model_len).")
    max_n: int = _setting(128, "Most completions (n) per request.")
    max_stop_strings: int = _setting(16, "Most stop strings per request.")
    max_stop_string_chars: int = _setting(256, "Longest stop string, in characters.")
    max_stop_token_ids: int = _setting(256, "Most stop_token_ids per request.")
    max_grammar_bytes: int = _setting(
        64 << 10, "Longest structured-output spec (JSON schema, regex, grammar, choices), "
                  "in UTF-8 bytes.")
    grammar_compile_timeout_s: float = _setting(
        10.0, "Structured output: a grammar that takes longer to compile is refused (its "
              "compiler process is killed).")
    grammar_cache_mib: int = _setting(
        64, "Structured output: compiled grammars kept, in MiB (the leader's cache, and "
            "again on rank 0).")
    json_any_whitespace: bool = _setting(
        False, "Structured output: let JSON outputs hold free whitespace. Off: compact "
               "separators only, so a model can never emit whitespace until max_tokens.")
    max_logit_bias: int = _setting(1024, "Most logit_bias entries per request.")
    max_plan_bytes: int = _setting(
        64 << 20, "Most bytes of new sequences (token ids, block tables) one step plan "
                  "carries; more wait for the next step. Keeps every plan far below the "
                  "workers' 256 MiB frame limit.")
    max_client_outbox: int = _setting(
        4096, "Most messages queued for a client that stops reading (beyond ZMQ's own "
              "buffer); past it the client is evicted and its requests aborted.")
    max_client_frames_per_step: int = _setting(
        256, "Most client messages the leader reads between two engine steps, so a flood "
             "delays its sender, not the running streams.")
    batch_timeout_ms: float = _setting(
        0.0, "When idle, wait this long for more arrivals before the first prefill.")
    client_timeout_s: float = _setting(
        10.0, "Abort the requests of a client silent for this long.")
    log_stats_interval_s: float = _setting(
        5.0, "Seconds between the engine's stats log lines.")
    worker_start_timeout_s: float = _setting(
        300.0, "Seconds the workers may take to start and load the model.")
    step_timeout_s: float = _setting(
        600.0, "Watchdog: a step without a result after this many seconds is an error.",
        flags=("--step-timeout",))
    heartbeat_timeout_s: float = _setting(
        4.0, "Seconds of heartbeat silence after which a worker (or, seen from a worker, "
             "the leader) counts as dead.", flags=("--heartbeat-timeout",))
    restart_workers: bool = _setting(
        False, "On a worker failure, start a new worker group and recompute the in-flight "
               "requests instead of failing them (workers on this node only).")
    max_worker_restarts: int = _setting(
        3, "With restart_workers: give up (and fail requests) after this many.")
    model_info: ModelInfo | None = field(default=None, repr=False)
    # Where config, tokenizer and weights are (resolve_source): made once per process.
    source: ModelSource | None = field(default=None, repr=False)

    def resolve_source(self) -> ModelInfo:
        """Resolve ``model`` (and ``tokenizer``) into ``source`` and read the checkpoint's
        facts into ``model_info`` (a GGUF file's metadata is converted on first use)."""
        self.model = str(Path(self.model).expanduser())
        self.source = resolve_model_source(self.model, self.tokenizer)
        self.model_info = ModelInfo.from_pretrained(self.source.config_dir)
        return self.model_info

    def _check_kv_cache_dtype(self) -> None:
        """auto becomes the run dtype; otherwise the run dtype itself, or bfloat16 under a
        float32 run on CPU (the kernels that read a cache of another type are the CPU ones)."""
        kv = self.kv_cache_dtype
        if kv == "auto" or kv == self.dtype:
            self.kv_cache_dtype = self.dtype
            return
        if kv not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv!r}")
        if not (kv == "bfloat16" and self.dtype == "float32" and self.device == "cpu"):
            raise ValueError(
                f"kv_cache_dtype={kv!r} with dtype={self.dtype!r} on {self.device}: a KV "
                f"cache of another type than the run's is bfloat16 under float32 on CPU "
                f"only; use kv_cache_dtype='auto' (the run dtype)")
        if self.attention_backend == "triton":  # its kernels take one dtype
            raise ValueError(
                "kv_cache_dtype='bfloat16' under dtype='float32' runs on the cpu or torch "
                "attention backend, not triton; use attention_backend='auto'")

    def finalize(self) -> EngineConfig:
        """Validate, resolve "auto" values and read the checkpoint's facts."""
        info = self.resolve_source()
        tp = self.tensor_parallel_size
        if not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {tp}")
        if self.device == "auto":
            self.device = _detect_device()
        if self.device not in DEVICES[1:]:
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        if self.dtype == "auto":
            self.dtype = info.torch_dtype if info.torch_dtype in DTYPES else "float32"
            if self.device == "cpu" and self.dtype == "float16":
                self.dtype = "bfloat16"  # fp16 matmuls on CPU are slow and lossy
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {DTYPES}, got {self.dtype!r}")
        self._check_kv_cache_dtype()
        # Any head count shards at any tp (by KV group, nvllm/worker/sharding.py), as long
        # as every rank gets a query head.
        heads, kv = info.num_attention_heads, info.num_key_value_heads
        if kv < 1 or heads % kv:
            raise ValueError(f"num_attention_heads={heads} is not a multiple of "
                             f"num_key_value_heads={kv}")
        if tp > heads:
            raise ValueError(
                f"tensor_parallel_size={tp} is larger than num_attention_heads={heads}: "
                "every rank needs at least one query head")
        if not isinstance(self.cpu_threads, int) or self.cpu_threads < 0:
            raise ValueError(f"cpu_threads must be >= 0 (0: automatic), got {self.cpu_threads}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_model_len is None:
            self.max_model_len = info.max_position_embeddings
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
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be auto, torch, triton or cpu, got "
                f"{self.attention_backend!r}"
            )
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got "
                             f"{self.quantization!r}")
        if self.speculative_config is not None:
            from nvllm.common.speculative import SpeculativeConfig

            self.speculative_config = SpeculativeConfig.from_dict(self.speculative_config)
            if self.speculative_config.uses_draft_model:
                check_draft_model(self.speculative_config, info)
        return self

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("model_info")
        d.pop("source")
        return d


def check_draft_model(spec: Any, target: ModelInfo) -> ModelInfo:
    """Resolve a draft model's checkpoint (``spec.model`` becomes its absolute path, as
    the workers read it) and refuse one the target cannot verify: another vocabulary
    (draft token ids must mean the target's tokens), or attention that reads further back
    than the target's sliding window (the leader frees blocks behind that window, and the
    draft's KV lives in the same blocks). Returns the draft's ModelInfo."""
    spec.model = str(Path(spec.model).expanduser().resolve())
    source = resolve_model_source(spec.model, None)
    info = ModelInfo.from_pretrained(source.config_dir)
    if info.vocab_size != target.vocab_size:
        raise ValueError(
            f"speculative_config.model: the draft model's vocabulary has {info.vocab_size} "
            f"tokens but the target's has {target.vocab_size}; a draft model must share "
            f"the target's vocabulary ({spec.model})")
    window = target.kv_window
    if window is not None and (info.kv_window is None or info.kv_window > window):
        raise ValueError(
            f"speculative_config.model: the target slides every layer (window {window}), "
            f"so blocks behind the window are freed; the draft model must slide too, by "
            f"at most {window} (its window: {info.kv_window})")
    return info


def engine_default(name: str) -> Any:
    """EngineConfig's default for field ``name``, for code that must wait or size something
    before any config exists (the torchrun worker waiting for its leader)."""
    return EngineConfig.__dataclass_fields__[name].default


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


def kv_cache_dtype(config: EngineConfig) -> Any:
    """The torch dtype the KV cache holds (config.kv_cache_dtype; auto: the run dtype)."""
    import torch

    name = config.kv_cache_dtype
    return getattr(torch, config.dtype if name == "auto" else name)
