"""Per-rank execution of step plans: the batch state (input_batch.InputBatch) turns a
plan into the step's arrays, then the forward pass and (rank 0) sampling."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import numpy as np
import torch

from nvllm.common import worker_protocol
from nvllm.common.config import EngineConfig, kv_cache_dtype
from nvllm.common.hf_config import load_hf_config
from nvllm.common.speculative import SpeculativeConfig
from nvllm.common.transport import ArrayReader
from nvllm.common.utils import cdiv
from nvllm.kernels.cpu_attention import CpuKVStore
from nvllm.kernels.metadata import AttentionMetadata, metadata_from_arrays
from nvllm.kernels.ops import resolve_backend, uses_cpu_attention
from nvllm.worker.cuda_graph import CUDAGraphRunner
from nvllm.worker.draft_runner import DraftRunner
from nvllm.worker.input_batch import InputBatch, InvalidPlan, StepBatch
from nvllm.worker.layers import quant
from nvllm.worker.layers.linear import pack_for_cpu
from nvllm.worker.loader import load_weights
from nvllm.worker.models import MODEL_REGISTRY, decode_stack
from nvllm.worker.parallel import TPContext
from nvllm.worker.quantize import quantize_model, share_tied_head, weight_bytes
from nvllm.worker.rejection_sampler import RejectionSampler
from nvllm.worker.sampler import Sampler, SampleRequest, logprob_entry
from nvllm.worker.structured_output import StructuredOutputState
from nvllm.worker.thread_tuner import ThreadTuner
from nvllm.worker.weight_update import WeightUpdater

logger = logging.getLogger(__name__)

MAX_GRAPH_BATCH = 512  # larger decode batches run eagerly (launch cost is amortized)
# Prompt rows scored per lm_head call: bounds the float32 logits a long chunk would
# otherwise materialize at once (rows x vocabulary).
PROMPT_LOGPROBS_ROWS = 256


def micro_batch_ranges(query_lens: Sequence[int] | np.ndarray, min_tokens: int
                       ) -> list[tuple[int, int]]:
    """Sequence ranges [a, b) of a step's micro-batches: two with about equal token
    counts when the step has at least min_tokens tokens and two sequences, else one."""
    q = np.asarray(query_lens, np.int64)
    n, total = len(q), int(q.sum())
    if n < 2 or total < min_tokens:
        return [(0, n)]
    prefix = np.cumsum(q[:-1])  # tokens before sequence j, for j = 1..n-1
    k = 1 + int(np.argmin(np.abs(2 * prefix - total)))  # first minimum, as min() picks
    return [(0, k), (k, n)]


class ModelRunner:
    def __init__(self, config: EngineConfig, tp: TPContext, device: torch.device) -> None:
        self.config = config
        self.tp = tp
        self.device = device
        self.dtype: torch.dtype = getattr(torch, config.dtype)  # a name in config.DTYPES
        self.kv_dtype: torch.dtype = kv_cache_dtype(config)
        self.block_size = config.block_size
        self.step_tokens = 0  # the last step's (the worker trims the heap after big ones)
        hf_config = load_hf_config(config.source.config_dir)
        arch = config.model_info.architecture
        self.backend = resolve_backend(config.attention_backend, device)
        with torch.device(device):
            self.model = MODEL_REGISTRY[arch](hf_config, tp, self.dtype,
                                              max(config.max_model_len, 1), self.backend,
                                              config.model_info.layer_windows,
                                              expert_parallel=config.enable_expert_parallel)
        # Layers held quantized (module name -> format), made so before loading.
        self.quantized = quantize_model(self.model, config.source, config.quantization,
                                        device)
        # (seconds, peak RSS MiB): reported to the leader, which logs them
        hf_shapes: dict[str, tuple[int, ...]] = {}
        self.load_stats = load_weights(self.model, config.source,
                                       show_progress=tp.rank == 0, shapes=hf_shapes)
        if self.quantized:
            share_tied_head(self.model)
        logger.info("rank %d holds %.1f MiB of weights (quantization=%s)", tp.rank,
                    weight_bytes(self.model) / 2**20, config.quantization)
        if self.quantized and device.type == "cpu" and tp.rank == 0:
            logger.info("quantized linears on this CPU: %s", quant.describe_cpu_routes())
        self.model.eval()
        if device.type == "cpu" and config.cpu_onednn_linear:
            pack_for_cpu(self.model)
        # Weight updates from a trainer (update_weights): staged, then applied on commit.
        self.weights = WeightUpdater(self.model, hf_shapes, self.quantized)
        self.sampler = Sampler(config.seed) if tp.rank == 0 else None
        self.rejection = RejectionSampler(self.sampler) if tp.rank == 0 else None
        # Rank 0 samples, so it alone holds the grammars and matchers.
        self.structured = StructuredOutputState() if tp.rank == 0 else None
        # Held sequences' tokens and block tables (sized with the KV cache).
        self.batch: InputBatch | None = None
        # Sequences whose plan asks to score their prompt (WorkerSampling.prompt_logprobs):
        # held on every rank alike, so a step without any costs one check.
        self.scoring: set[int] = set()
        self.kv_cache: torch.Tensor | None = None
        # The CPU attention backend's contiguous per-sequence K/V (made with the cache).
        self.cpu_kv: CpuKVStore | None = None
        # Decode steps from CUDA graphs: the Triton kernels size their grids from shapes
        # only (the torch backend loops over host-side lengths, which a graph would freeze).
        self.use_cuda_graphs = (device.type == "cuda" and self.backend == "triton"
                                and self.model.graph_safe
                                and not config.enforce_eager)
        self.graph_batch_size = min(config.max_num_seqs, MAX_GRAPH_BATCH)
        self.graphs: CUDAGraphRunner | None = None
        # CPU, tp=1: each step's torch thread count, by measurement (the worker sets it
        # when cpu_thread_tuning is on and it has threads to choose from).
        self.threads: ThreadTuner | None = None
        attn0 = self.model.layers[0].self_attn
        self.num_kv_heads, self.head_dim = attn0.num_kv_heads, attn0.head_dim
        # Draft-model speculative decoding: the draft lives on rank 0 only (draft_runner).
        spec = config.speculative_config
        self.draft: DraftRunner | None = None
        if (tp.rank == 0 and spec is not None
                and SpeculativeConfig.from_dict(spec).uses_draft_model):
            self.draft = DraftRunner(config, device, self.dtype, self.backend)

    # ---- KV cache -------------------------------------------------------------------

    def block_bytes(self) -> int:
        layers = len(self.model.layers)
        draft = self.draft.block_bytes(self.block_size) if self.draft is not None else 0
        return (2 * layers * self.block_size * self.num_kv_heads * self.head_dim
                * self.kv_dtype.itemsize) + draft

    def available_kv_blocks(self) -> int:
        """How many KV blocks this rank can hold within its memory budget."""
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            budget = total * self.config.gpu_memory_utilization - used
            # Keep room for activations of a full batch (measured-free estimate: the
            # largest step's hidden states and logits a few times over).
            per_token = 16 * self.model.embed_tokens.embedding_dim * self.dtype.itemsize
            peak = self.config.max_num_batched_tokens * per_token
            if self.use_cuda_graphs:
                # The decode graphs' private pool: one largest batch's activations, plus
                # room for the graphs themselves.
                peak += self.graph_batch_size * per_token + (64 << 20)
            return max(0, int((budget - peak) // self.block_bytes()))
        return int(self.config.cpu_kv_cache_gib * (1 << 30) // self.block_bytes())

    def init_kv_cache(self, num_blocks: int) -> None:
        decode_stack.forget(self.model)  # it holds the caches this replaces
        layers = len(self.model.layers)
        self.kv_cache = torch.zeros(2, layers, num_blocks, self.block_size, self.num_kv_heads,
                                    self.head_dim, dtype=self.kv_dtype, device=self.device)
        for i, layer in enumerate(self.model.layers):
            layer.self_attn.attn.k_cache = self.kv_cache[0, i]
            layer.self_attn.attn.v_cache = self.kv_cache[1, i]
            layer.self_attn.attn.layer_idx = i
        if self.draft is not None:
            self.draft.init_kv_cache(num_blocks, self.block_size)
        cfg = self.config
        self.batch = InputBatch(cfg.max_num_seqs, cfg.max_model_len,
                                cdiv(cfg.max_model_len, self.block_size), self.block_size,
                                cfg.model_info.vocab_size, num_blocks)
        if uses_cpu_attention(self.backend, self.device, self.config.cpu_kv_mirror):
            # A second copy of what running sequences hold, so it gets its own budget.
            self.cpu_kv = CpuKVStore(self.kv_cache, int(self.config.cpu_kv_cache_gib * (1 << 30)),
                                     self.config.max_model_len,
                                     native_decode=self.backend == "cpu",
                                     window=self.config.model_info.kv_window)
        if self.use_cuda_graphs:
            self.capture_graphs()

    def capture_graphs(self, graph_factory=None) -> None:
        """Capture the decode graphs (after the KV cache exists: they address it)."""
        self.graphs = CUDAGraphRunner(
            self.model, self.graph_batch_size, cdiv(self.config.max_model_len, self.block_size),
            self.block_size, self.device, graph_factory)
        self.graphs.capture()

    def load_grammars(self, msg: worker_protocol.LoadGrammars) -> None:
        if self.structured is not None:
            self.structured.load(msg)

    def _forget(self, sid: int) -> None:
        """Drop what this rank keeps beside the batch state for a sequence the plan ends
        (its row is the batch state's: InputBatch.apply frees it, and a sequence resumed
        in the same plan has a new row by then)."""
        self.scoring.discard(sid)
        if self.structured is not None:
            self.structured.drop(sid)
        if self.cpu_kv is not None:
            self.cpu_kv.drop(sid)

    # ---- one step -------------------------------------------------------------------

    def _apply(self, plan: worker_protocol.StepPlan, reader: ArrayReader | None) -> StepBatch:
        """Validate the plan whole (InvalidPlan: nothing changed), then apply it to the
        batch state and to what rank 0 keeps beside it (matchers, prompt scoring)."""
        if self.kv_cache is None:
            raise InvalidPlan("a step plan arrived before the KV cache was allocated")
        batch = self.batch
        step = batch.apply(plan, reader)  # frees the finished sequences' rows
        for sid in plan.finished_ids:
            self._forget(sid)
        for i, sampling in enumerate(plan.new_cols.sampling):
            sid, row = int(step.seq_ids[i]), int(step.rows[i])
            if sampling.prompt_logprobs is not None:
                self.scoring.add(sid)
            if sampling.grammar_key is not None and self.structured is not None:
                self.structured.start(sid, sampling, batch.tokens(row)[
                    batch.num_prompt_tokens[row]:].tolist())
        return step

    def _prepare(self, step: StepBatch) -> tuple[list[tuple[torch.Tensor, torch.Tensor,
                                                             AttentionMetadata]], bool]:
        """Inputs of the step's micro-batches (input ids, positions, metadata) and whether
        a decode graph runs the step."""
        graphed = self.graphs is not None and self.graphs.can_run(
            step.num_seqs, step.num_tokens, step.block_tables.shape[1])
        # A graph replays the whole batch; otherwise big tensor-parallel steps are cut.
        overlap = (self.config.micro_batch_overlap and self.tp.world_size > 1
                   and not graphed)
        ranges = (micro_batch_ranges(step.query_lens, self.config.micro_batch_min_tokens)
                  if overlap else [(0, step.num_seqs)])
        cu = step.cu_seqlens_q
        micro = []
        for a, b in ranges:
            t0, t1 = int(cu[a]), int(cu[b])
            meta = metadata_from_arrays(step.slot_mapping[t0:t1], cu[a:b + 1] - cu[a],
                                        step.seq_lens[a:b], step.block_tables[a:b],
                                        self.device)
            if self.cpu_kv is not None:
                meta.cpu_kv = self.cpu_kv.views_for_step(
                    step.seq_ids[a:b].tolist(), list(step.block_tables[a:b]),
                    step.query_lens[a:b].tolist(), step.seq_lens[a:b].tolist())
            micro.append((self._tensor(step.input_ids[t0:t1]),
                          self._tensor(step.positions[t0:t1]), meta))
        return micro, graphed

    def _tensor(self, a: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(a)
        return t if self.device.type == "cpu" else t.to(self.device)

    @torch.inference_mode()
    def execute(self, plan: worker_protocol.StepPlan, reader: ArrayReader | None = None
                ) -> worker_protocol.StepResult | None:
        """Run one plan; `reader`: the plan ring, when its columns may live there."""
        t0 = time.perf_counter()
        step = self._apply(plan, reader)
        self.step_tokens = step.num_tokens
        if not step.num_seqs:
            return (worker_protocol.StepResult(plan.step_id, [], [], None, 0.0)
                    if self.tp.rank == 0 else None)
        if self.threads is None:
            return self._run(plan, step, t0)
        self.threads.begin(step.num_tokens)
        try:
            return self._run(plan, step, t0)
        finally:
            self.threads.end()

    def _run(self, plan: worker_protocol.StepPlan, step: StepBatch, t0: float
             ) -> worker_protocol.StepResult | None:
        """The applied step's forward pass, then sampling (or verifying drafts)."""
        micro, graphed = self._prepare(step)
        if graphed:
            hidden = self.graphs.run(*micro[0])
        else:
            hiddens = self.tp.run([self.model.stages(*mb) for mb in micro])
            hidden = hiddens[0] if len(hiddens) == 1 else torch.cat(hiddens)
        prompt_lps = self._prompt_logprobs(step, hidden)
        if step.spec_lens is not None and step.spec_lens.any():
            result = self._verify(plan, step, hidden, prompt_lps, t0)
        else:
            result = self._sample(plan, step, hidden, prompt_lps, t0)
        if self.draft is not None:  # rank 0: the draft's KV, then its proposals
            result.draft_token_ids = self.draft.run(step, self.batch, plan.draft_seq_ids,
                                                    plan.num_draft_tokens)
            result.worker_time_s = time.perf_counter() - t0
        return result

    def _sample(self, plan: worker_protocol.StepPlan, step: StepBatch, hidden: torch.Tensor,
                prompt_lps: list | None, t0: float) -> worker_protocol.StepResult | None:
        """Plain sampling: one token for each row whose known tokens are all computed."""
        sample_rows = step.rows[step.sample_idx]
        sample_ids = step.seq_ids[step.sample_idx].tolist()
        logits = (self.model.compute_logits(hidden[torch.from_numpy(step.logits_indices)
                                                   .to(hidden.device)])
                  if sample_ids else None)
        tokens, logprobs = [], None
        if sample_ids and self.tp.rank == 0:
            so, batch = self.structured, self.batch
            reqs = [SampleRequest(batch.sampling[row], batch.tokens(row),
                                  int(batch.num_prompt_tokens[row]),
                                  so.matcher(sid) if so.matchers else None)
                    for sid, row in zip(sample_ids, sample_rows.tolist())]
            tokens, logprobs = self.sampler(logits, reqs)
            if so.matchers:
                for sid, token in zip(sample_ids, tokens):
                    so.accept(sid, token)
        if sample_ids and self.tp.world_size > 1:
            # Every rank keeps the sampled tokens itself: the next plan (possibly already
            # sent, with async scheduling) computes them without a trip through the leader.
            t = (torch.tensor(tokens, dtype=torch.long, device=self.device) if self.tp.rank == 0
                 else torch.empty(len(sample_ids), dtype=torch.long, device=self.device))
            tokens = self.tp.broadcast_from_first(t).tolist()
        self.batch.append_sampled(sample_rows, np.asarray(tokens, np.int64))
        if self.tp.rank != 0:
            return None
        return worker_protocol.StepResult(plan.step_id, sample_ids, tokens,
                                          logprobs, time.perf_counter() - t0, prompt_lps)

    def _verify(self, plan: worker_protocol.StepPlan, step: StepBatch, hidden: torch.Tensor,
                prompt_lps: list | None, t0: float) -> worker_protocol.StepResult | None:
        """A step in which some rows verify draft tokens (speculative decoding): logits for
        each such row's 1 + d positions, rank 0 accepts or rejects the drafts
        (rejection_sampler.RejectionSampler; plain rows sample as ever), every rank takes
        the emitted tokens (rank 0 broadcasts them, padded to [rows, 1 + max d]) and each
        row's known tokens grow by them, its computed count by its accepted drafts.
        Verify rows run the CPU backend's multi-query path (as a prefill chunk does), not
        the one-query native decode kernel."""
        batch = self.batch
        sample_rows = step.rows[step.sample_idx]
        sample_ids = step.seq_ids[step.sample_idx].tolist()
        spec, off = step.spec_lens, step.logits_offsets
        logits = self.model.compute_logits(
            hidden[torch.from_numpy(step.logits_indices).to(hidden.device)])
        width = 1 + int(spec.max())
        emitted: list[list[int]] = []
        logprobs = None
        if self.tp.rank == 0:
            so = self.structured
            reqs = [SampleRequest(batch.sampling[row], batch.tokens(row),
                                  int(batch.num_prompt_tokens[row]),
                                  so.matcher(sid) if so.matchers else None)
                    for sid, row in zip(sample_ids, sample_rows.tolist())]
            n0 = batch.num_tokens[sample_rows]
            drafts = [batch.token_ids[row, n:n + d] for row, n, d in
                      zip(sample_rows.tolist(), n0.tolist(), spec.tolist())]
            emitted = self.rejection.verify_rows(logits, off, reqs, drafts)
            if so.matchers:
                for sid, toks in zip(sample_ids, emitted):
                    for t in toks:
                        so.accept(sid, t)
            if any(r.params.logprobs is not None for r in reqs):
                logprobs = self._token_logprobs(logits, off, reqs, emitted)
        if self.tp.world_size > 1:
            t = torch.full((len(sample_ids), width), -1, dtype=torch.long, device=self.device)
            if self.tp.rank == 0:
                for i, toks in enumerate(emitted):
                    t[i, :len(toks)] = torch.tensor(toks, dtype=torch.long)
            t = self.tp.broadcast_from_first(t).cpu()
            emitted = [[int(x) for x in r if x >= 0] for r in t.tolist()]
        counts = np.fromiter((len(e) for e in emitted), np.int64, len(emitted))
        flat = [x for e in emitted for x in e]
        batch.append_verified(sample_rows, counts, np.asarray(flat, np.int64), spec)
        if self.tp.rank != 0:
            return None
        return worker_protocol.StepResult(plan.step_id, sample_ids, flat, logprobs,
                                          time.perf_counter() - t0, prompt_lps,
                                          counts.tolist())

    @staticmethod
    def _token_logprobs(logits: torch.Tensor, off: np.ndarray, reqs: list[SampleRequest],
                        emitted: list[list[int]]) -> list:
        """One entry per emitted token (None for rows that did not ask): the model's own
        logprobs at the token's position, as the sampler reports them."""
        out: list = []
        for i, (req, toks) in enumerate(zip(reqs, emitted)):
            k = req.params.logprobs
            if k is None:
                out += [None] * len(toks)
                continue
            lp = torch.log_softmax(logits[int(off[i]):int(off[i]) + len(toks)].float(), -1)
            out += [logprob_entry(lp[j], t, k) for j, t in enumerate(toks)]
        return out

    def _prompt_logprobs(self, step: StepBatch, hidden: torch.Tensor) -> list | None:
        """Score the prompt positions this step computes for sequences that asked
        (``WorkerSampling.prompt_logprobs``): the hidden row of position i predicts prompt
        token i + 1. Every rank runs the same lm_head calls (its gather is a collective;
        the plan, hence the rows, is the same on all ranks); rank 0 returns
        StepResult.prompt_logprobs' entries, the others None."""
        if not self.scoring:
            return None
        batch = self.batch
        rows: list[np.ndarray] = []
        targets: list[np.ndarray] = []
        ks: list[np.ndarray] = []
        spans: list[tuple[int, int, int]] = []  # (seq id, first prompt token scored, count)
        for i in range(step.num_seqs):
            sid, row = int(step.seq_ids[i]), int(step.rows[i])
            if sid not in self.scoring:
                continue
            k = batch.sampling[row].prompt_logprobs
            start, n = int(step.start[i]), int(step.query_lens[i])
            num_prompt = int(batch.num_prompt_tokens[row])
            end = min(start + n, num_prompt - 1)  # the last row predicts no prompt token
            if end >= num_prompt - 1:
                self.scoring.discard(sid)  # this step scores its last prompt position
            if end > start:
                first_row = int(step.cu_seqlens_q[i])
                rows.append(np.arange(first_row, first_row + end - start))
                targets.append(batch.token_ids[row, start + 1:end + 1])
                ks.append(np.full(end - start, k))
                spans.append((sid, start + 1, end - start))
        if not rows:
            return None
        entries = self._score_rows(hidden, np.concatenate(rows), np.concatenate(targets),
                                   np.concatenate(ks))
        if self.tp.rank != 0:
            return None
        out, pos = [], 0
        for sid, first, count in spans:
            out.append([sid, first, entries[pos:pos + count]])
            pos += count
        return out

    def _score_rows(self, hidden: torch.Tensor, rows: np.ndarray, targets: np.ndarray,
                    ks: np.ndarray) -> list[list]:
        """[logprob of the target, [[id, logprob], ...top k]] per row (rank 0; others
        take part in the lm_head's gather and get [])."""
        entries: list[list] = []
        for a in range(0, len(rows), PROMPT_LOGPROBS_ROWS):
            sl = slice(a, a + PROMPT_LOGPROBS_ROWS)
            logits = self.model.compute_logits(
                hidden[torch.from_numpy(rows[sl]).to(hidden.device)])
            if logits is None:  # not rank 0: the gather is all this rank takes part in
                continue
            lp = torch.log_softmax(logits.float(), dim=-1)
            tgt = torch.from_numpy(targets[sl].astype(np.int64)).to(lp.device)
            chosen = lp.gather(1, tgt[:, None])[:, 0].tolist()
            kmax = int(ks[sl].max())
            top_v, top_i = (torch.topk(lp, kmax) if kmax else (lp[:, :0], lp[:, :0].long()))
            for j, (v, ids) in enumerate(zip(top_v.tolist(), top_i.tolist())):
                k = int(ks[a + j])
                entries.append([chosen[j], [[t, x] for t, x in zip(ids[:k], v[:k])]])
        return entries
