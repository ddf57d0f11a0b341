"""Per-rank execution of step plans: worker-side sequence state, input preparation,
the forward pass, and (rank 0) sampling."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import torch

from nvllm.common import worker_protocol
from nvllm.common.config import EngineConfig
from nvllm.common.utils import cdiv
from nvllm.kernels.cpu_attention import CpuKVStore
from nvllm.kernels.metadata import AttentionMetadata, build_metadata
from nvllm.kernels.ops import resolve_backend, uses_cpu_attention
from nvllm.worker.cuda_graph import CUDAGraphRunner
from nvllm.worker.layers.linear import pack_for_cpu
from nvllm.worker.loader import load_weights
from nvllm.worker.models import MODEL_REGISTRY
from nvllm.worker.parallel import TPContext
from nvllm.worker.sampler import Sampler, SampleRequest
from nvllm.worker.structured_output import StructuredOutputState

MAX_GRAPH_BATCH = 512  # larger decode batches run eagerly (launch cost is amortized)
# Prompt rows scored per lm_head call: bounds the float32 logits a long chunk would
# otherwise materialize at once (rows x vocabulary).
PROMPT_LOGPROBS_ROWS = 256


def micro_batch_ranges(query_lens: list[int], min_tokens: int) -> list[tuple[int, int]]:
    """Sequence ranges [a, b) of a step's micro-batches: two with about equal token
    counts when the step has at least min_tokens tokens and two sequences, else one."""
    n, total = len(query_lens), sum(query_lens)
    if n < 2 or total < min_tokens:
        return [(0, n)]
    prefix = list(itertools.accumulate(query_lens[:-1]))
    k = min(range(1, n), key=lambda j: abs(2 * prefix[j - 1] - total))
    return [(0, k), (k, n)]


class InvalidPlan(ValueError):
    """A step plan that cannot be executed; the worker's state is left as it was."""


@dataclass(slots=True)
class WorkerSeq:
    token_ids: list[int]
    num_prompt_tokens: int
    num_computed_tokens: int
    block_table: list[int]
    sampling: worker_protocol.WorkerSampling


class ModelRunner:
    def __init__(self, config: EngineConfig, tp: TPContext, device: torch.device) -> None:
        from transformers import AutoConfig

        self.config = config
        self.tp = tp
        self.device = device
        self.dtype: torch.dtype = getattr(torch, config.dtype)  # a name in config.DTYPES
        self.block_size = config.block_size
        hf_config = AutoConfig.from_pretrained(config.source.config_dir)
        arch = config.model_info.architecture
        self.backend = resolve_backend(config.attention_backend, device)
        with torch.device(device):
            self.model = MODEL_REGISTRY[arch](hf_config, tp, self.dtype,
                                              max(config.max_model_len, 1), self.backend,
                                              config.model_info.layer_windows,
                                              expert_parallel=config.enable_expert_parallel)
        # (seconds, peak RSS MiB): reported to the leader, which logs them
        self.load_stats = load_weights(self.model, config.source,
                                       show_progress=tp.rank == 0)
        self.model.eval()
        if device.type == "cpu" and config.cpu_onednn_linear:
            pack_for_cpu(self.model)
        self.sampler = Sampler(config.seed) if tp.rank == 0 else None
        # Rank 0 samples, so it alone holds the grammars and matchers.
        self.structured = StructuredOutputState() if tp.rank == 0 else None
        self.seqs: dict[int, WorkerSeq] = {}
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
        attn0 = self.model.layers[0].self_attn
        self.num_kv_heads, self.head_dim = attn0.num_kv_heads, attn0.head_dim

    # ---- KV cache -------------------------------------------------------------------

    def block_bytes(self) -> int:
        layers = len(self.model.layers)
        return (2 * layers * self.block_size * self.num_kv_heads * self.head_dim
                * self.dtype.itemsize)

    def available_kv_blocks(self) -> int:
        """How many KV blocks this rank can hold within its memory budget."""
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            budget = total * self.config.gpu_memory_utilization - used
            # Keep room for activations of a full batch (measured-free estimate: the
            # largest step's hidden states and logits a few times over).
            per_token = 16 * self.model.embed_tokens.weight.shape[1] * self.dtype.itemsize
            peak = self.config.max_num_batched_tokens * per_token
            if self.use_cuda_graphs:
                # The decode graphs' private pool: one largest batch's activations, plus
                # room for the graphs themselves.
                peak += self.graph_batch_size * per_token + (64 << 20)
            return max(0, int((budget - peak) // self.block_bytes()))
        return int(self.config.cpu_kv_cache_gib * (1 << 30) // self.block_bytes())

    def init_kv_cache(self, num_blocks: int) -> None:
        layers = len(self.model.layers)
        self.kv_cache = torch.zeros(2, layers, num_blocks, self.block_size, self.num_kv_heads,
                                    self.head_dim, dtype=self.dtype, device=self.device)
        for i, layer in enumerate(self.model.layers):
            layer.self_attn.attn.k_cache = self.kv_cache[0, i]
            layer.self_attn.attn.v_cache = self.kv_cache[1, i]
            layer.self_attn.attn.layer_idx = i
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

    def _drop(self, sid: int) -> None:
        self.seqs.pop(sid, None)
        self.scoring.discard(sid)
        if self.structured is not None:
            self.structured.drop(sid)
        if self.cpu_kv is not None:
            self.cpu_kv.drop(sid)

    # ---- one step -------------------------------------------------------------------

    def validate(self, plan: worker_protocol.StepPlan) -> None:
        """Reject a plan this rank cannot execute before touching any state.

        Plans come from the leader only, so a bad one is a bug (or a forged frame): the
        worker answers with an error and stays as it was, instead of indexing out of its
        KV cache or embedding table.
        """
        if self.kv_cache is None:
            raise InvalidPlan("a step plan arrived before the KV cache was allocated")
        num_blocks, vocab, bs = self.kv_cache.shape[2], self.config.model_info.vocab_size, \
            self.block_size
        dropped = set(plan.finished_ids)
        seen: set[int] = set()

        def held(sid: int) -> WorkerSeq | None:
            return None if sid in dropped else self.seqs.get(sid)

        def check(sid, tokens, blocks, num_tokens, num_blocks_held, computed, n) -> None:
            if sid in seen:
                raise InvalidPlan(f"sequence {sid} appears twice in step {plan.step_id}")
            seen.add(sid)
            if any(not 0 <= t < vocab for t in tokens):
                raise InvalidPlan(f"sequence {sid}: token id outside the vocabulary "
                                  f"(0..{vocab - 1})")
            if any(not 0 <= b < num_blocks for b in blocks):
                raise InvalidPlan(f"sequence {sid}: block id outside the KV cache "
                                  f"(0..{num_blocks - 1})")
            end = computed + n
            if n < 1 or computed < 0 or end > num_tokens or cdiv(end, bs) > num_blocks_held:
                raise InvalidPlan(f"sequence {sid}: tokens {computed}..{end} of {num_tokens} "
                                  f"with {num_blocks_held} block(s) of {bs}")

        for ns in plan.new_seqs:
            if held(ns.seq_id) is not None:
                raise InvalidPlan(f"new sequence {ns.seq_id} is already held")
            if not 0 < ns.num_prompt_tokens <= len(ns.token_ids):
                raise InvalidPlan(f"sequence {ns.seq_id}: {ns.num_prompt_tokens} prompt tokens "
                                  f"of {len(ns.token_ids)}")
            check(ns.seq_id, ns.token_ids, ns.block_table, len(ns.token_ids),
                  len(ns.block_table), ns.num_computed_tokens, ns.num_new_tokens)
        for rs in plan.running:
            seq = held(rs.seq_id)
            if seq is None:
                raise InvalidPlan(f"running sequence {rs.seq_id} is not held by this worker")
            check(rs.seq_id, (), rs.new_block_ids, len(seq.token_ids),
                  len(seq.block_table) + len(rs.new_block_ids), seq.num_computed_tokens,
                  rs.num_new_tokens)

    def _apply_plan(self, plan: worker_protocol.StepPlan) -> list[tuple[WorkerSeq, int]]:
        for sid in plan.finished_ids:
            self._drop(sid)
        batch = []
        for ns in plan.new_seqs:
            seq = WorkerSeq(ns.token_ids, ns.num_prompt_tokens, ns.num_computed_tokens,
                            ns.block_table, ns.sampling)
            self.seqs[ns.seq_id] = seq
            if ns.sampling.prompt_logprobs is not None:
                self.scoring.add(ns.seq_id)
            if ns.sampling.grammar_key is not None and self.structured is not None:
                self.structured.start(ns.seq_id, ns.sampling,
                                      ns.token_ids[ns.num_prompt_tokens:])
            batch.append((ns.seq_id, seq, ns.num_new_tokens))
        for rs in plan.running:
            seq = self.seqs[rs.seq_id]
            seq.block_table.extend(rs.new_block_ids)
            batch.append((rs.seq_id, seq, rs.num_new_tokens))
        return batch

    def _prepare(self, batch) -> tuple[list[tuple[torch.Tensor, torch.Tensor,
                                                   AttentionMetadata]], list[int], bool]:
        """Inputs of the step's micro-batches (input ids, positions, metadata), the rows
        of the concatenated hidden states to sample from, and whether a decode graph
        runs the step."""
        bs = self.block_size
        input_ids: list[int] = []
        query_lens: list[int] = []
        context_lens: list[int] = []
        sample_rows: list[int] = []
        for _, seq, n in batch:
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            if end > len(seq.token_ids) or cdiv(end, bs) > len(seq.block_table):
                raise RuntimeError(f"plan asks for tokens {start}..{end} of a sequence with "
                                   f"{len(seq.token_ids)} tokens, {len(seq.block_table)} blocks")
            input_ids.extend(seq.token_ids[start:end])
            query_lens.append(n)
            context_lens.append(end)
            if end == len(seq.token_ids):
                sample_rows.append(len(input_ids) - 1)
        micro, tok = [], 0
        graphed = self.graphs is not None and self.graphs.can_run(
            len(batch), len(input_ids), max(len(s.block_table) for _, s, _ in batch))
        # A graph replays the whole batch; otherwise big tensor-parallel steps are cut.
        overlap = (self.config.micro_batch_overlap and self.tp.world_size > 1
                   and not graphed)
        ranges = (micro_batch_ranges(query_lens, self.config.micro_batch_min_tokens)
                  if overlap else [(0, len(batch))])
        for a, b in ranges:
            meta, positions = build_metadata(query_lens[a:b], context_lens[a:b],
                                             [s.block_table for _, s, _ in batch[a:b]], bs,
                                             self.device)
            if self.cpu_kv is not None:
                meta.cpu_kv = self.cpu_kv.views_for_step(
                    [sid for sid, _, _ in batch[a:b]], [s.block_table for _, s, _ in batch[a:b]],
                    query_lens[a:b], context_lens[a:b])
            num = sum(query_lens[a:b])
            ids = torch.tensor(input_ids[tok:tok + num], dtype=torch.long, device=self.device)
            micro.append((ids, positions, meta))
            tok += num
        return micro, sample_rows, graphed

    @torch.inference_mode()
    def execute(self, plan: worker_protocol.StepPlan) -> worker_protocol.StepResult | None:
        t0 = time.perf_counter()
        self.validate(plan)
        batch = self._apply_plan(plan)
        if not batch:
            return (worker_protocol.StepResult(plan.step_id, [], [], None, 0.0)
                    if self.tp.rank == 0 else None)
        micro, sample_rows, graphed = self._prepare(batch)
        if graphed:
            hidden = self.graphs.run(*micro[0])
        else:
            hiddens = self.tp.run([self.model.stages(*mb) for mb in micro])
            hidden = hiddens[0] if len(hiddens) == 1 else torch.cat(hiddens)
        sampling = [(sid, seq) for sid, seq, n in batch
                    if seq.num_computed_tokens + n == len(seq.token_ids)]
        prompt_lps = self._prompt_logprobs(batch, hidden)
        for _, seq, n in batch:
            seq.num_computed_tokens += n
        logits = self.model.compute_logits(hidden[sample_rows]) if sample_rows else None
        tokens, logprobs = [], None
        if sampling and self.tp.rank == 0:
            so = self.structured
            reqs = [SampleRequest(seq.sampling, seq.token_ids, seq.num_prompt_tokens,
                                  so.matcher(sid) if so.matchers else None)
                    for sid, seq in sampling]
            tokens, logprobs = self.sampler(logits, reqs)
            if so.matchers:
                for (sid, _), token in zip(sampling, tokens):
                    so.accept(sid, token)
        if sampling and self.tp.world_size > 1:
            # Every rank keeps the sampled tokens itself: the next plan (possibly already
            # sent, with async scheduling) computes them without a trip through the leader.
            t = (torch.tensor(tokens, dtype=torch.long, device=self.device) if self.tp.rank == 0
                 else torch.empty(len(sampling), dtype=torch.long, device=self.device))
            tokens = self.tp.broadcast_from_first(t).tolist()
        for (_, seq), token in zip(sampling, tokens):
            seq.token_ids.append(token)
        if self.tp.rank != 0:
            return None
        return worker_protocol.StepResult(plan.step_id, [sid for sid, _ in sampling], tokens,
                                   logprobs, time.perf_counter() - t0, prompt_lps)

    def _prompt_logprobs(self, batch, hidden: torch.Tensor) -> list | None:
        """Score the prompt positions this step computes for sequences that asked
        (``WorkerSampling.prompt_logprobs``), before their computed counts advance: the
        hidden row of position i predicts prompt token i + 1. Every rank runs the same
        lm_head calls (its gather is a collective; the plan, hence the rows, is the same on
        all ranks); rank 0 returns StepResult.prompt_logprobs' entries, the others None."""
        if not self.scoring:
            return None
        rows: list[int] = []
        targets: list[int] = []
        ks: list[int] = []
        spans: list[tuple[int, int, int]] = []  # (seq id, first prompt token scored, count)
        offset = 0
        for sid, seq, n in batch:
            k = seq.sampling.prompt_logprobs
            start = seq.num_computed_tokens
            end = min(start + n, seq.num_prompt_tokens - 1)  # the last row predicts no prompt
            if k is not None and end >= seq.num_prompt_tokens - 1:
                self.scoring.discard(sid)  # this step scores its last prompt position
            if k is not None and end > start:
                rows.extend(range(offset, offset + end - start))
                targets.extend(seq.token_ids[start + 1:end + 1])
                ks.extend([k] * (end - start))
                spans.append((sid, start + 1, end - start))
            offset += n
        if not rows:
            return None
        entries: list[list] = []
        for a in range(0, len(rows), PROMPT_LOGPROBS_ROWS):
            logits = self.model.compute_logits(hidden[rows[a:a + PROMPT_LOGPROBS_ROWS]])
            if logits is None:  # not rank 0: the gather is all this rank takes part in
                continue
            lp = torch.log_softmax(logits.float(), dim=-1)
            tgt = torch.tensor(targets[a:a + len(lp)], dtype=torch.long, device=lp.device)
            chosen = lp.gather(1, tgt[:, None])[:, 0].tolist()
            kmax = max(ks[a:a + len(lp)])
            top_v, top_i = (torch.topk(lp, kmax) if kmax else (lp[:, :0], lp[:, :0].long()))
            for j, (v, ids) in enumerate(zip(top_v.tolist(), top_i.tolist())):
                k = ks[a + j]
                entries.append([chosen[j], [[t, x] for t, x in zip(ids[:k], v[:k])]])
        if self.tp.rank != 0:
            return None
        out, pos = [], 0
        for sid, first, count in spans:
            out.append([sid, first, entries[pos:pos + count]])
            pos += count
        return out
