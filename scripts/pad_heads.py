#!/usr/bin/env python
"""Copy an HF safetensors checkpoint with its attention zero-padded to head counts a
tensor-parallel size divides (what SGLang does on CPU instead of sharding by KV group).

KV heads are added at the end until tp divides their number (or their number divides
tp), each with a full group of query heads, so every original query head keeps its KV
head. The added heads are zero: q/k/v rows (and biases) zero, o_proj columns zero. A
padded query head then attends over zero keys and zero values and o_proj drops its
output anyway: the model computes exactly the same function, with more heads.
config.json gets the new head counts and an explicit head_dim.

    python scripts/pad_heads.py SRC DST --tp 2     # SmolLM2-135M: 9 / 3 -> 12 / 4 heads

Then compare the engine's KV-group shards with padded heads end to end:

    nvllm-bench throughput --model SRC --tp 2 ...
    nvllm-bench throughput --model DST --tp 2 ...
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

import torch

ATTN = re.compile(r"\.self_attn\.(q_proj|k_proj|v_proj|o_proj)\.(weight|bias)$")


def padded_kv_heads(kv: int, tp: int) -> int:
    """The fewest KV heads >= kv that shard evenly: a multiple of tp, or a divisor of it."""
    if kv < tp and tp % kv == 0:
        return kv
    n = kv
    while n % tp and not (n < tp and tp % n == 0):
        n += 1
    return n


def pad_tensor(name: str, t: torch.Tensor, head_dim: int, heads: int, kv: int,
               new_heads: int, new_kv: int) -> torch.Tensor:
    m = ATTN.search(name)
    if m is None:
        return t
    proj, kind = m.groups()
    if proj == "o_proj":
        if kind == "bias":
            return t
        extra = torch.zeros(t.shape[0], (new_heads - heads) * head_dim, dtype=t.dtype)
        return torch.cat([t, extra], dim=1).contiguous()
    rows = (new_heads - heads if proj == "q_proj" else new_kv - kv) * head_dim
    extra = torch.zeros((rows, *t.shape[1:]), dtype=t.dtype)
    return torch.cat([t, extra], dim=0).contiguous()


def pad_checkpoint(src: str | Path, dst: str | Path, tp: int) -> tuple[int, int]:
    """Write the padded copy of `src` to `dst`; returns the new (query, KV) head counts."""
    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    cfg = json.loads((src / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    new_kv = padded_kv_heads(kv, tp)
    new_heads = new_kv * (heads // kv)
    dst.mkdir(parents=True, exist_ok=True)
    total = 0
    for f in sorted(src.iterdir()):
        if f.is_dir() or f.name == "config.json" or f.name.endswith(".index.json"):
            continue
        if f.suffix != ".safetensors":
            shutil.copy2(f, dst / f.name)
            continue
        tensors = {k: pad_tensor(k, v, head_dim, heads, kv, new_heads, new_kv)
                   for k, v in load_file(f).items()}
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        save_file(tensors, dst / f.name, metadata={"format": "pt"})
    for f in src.glob("*.safetensors.index.json"):
        index = json.loads(f.read_text())
        index.setdefault("metadata", {})["total_size"] = total
        (dst / f.name).write_text(json.dumps(index, indent=2))
    cfg.update(num_attention_heads=new_heads, num_key_value_heads=new_kv, head_dim=head_dim)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return new_heads, new_kv


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", help="HF checkpoint folder (safetensors)")
    ap.add_argument("dst", help="where to write the padded copy")
    ap.add_argument("--tp", type=int, required=True, help="the tensor-parallel size to pad for")
    args = ap.parse_args()
    heads, kv = pad_checkpoint(args.src, args.dst, args.tp)
    print(f"{args.dst}: {heads} query / {kv} KV heads")


if __name__ == "__main__":
    main()
