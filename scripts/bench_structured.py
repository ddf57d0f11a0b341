"""What structured output costs: the same batch offline, once with every request held to
a JSON schema (rank 0 fills and applies one token mask per constrained sequence per step)
and once free, each free request running exactly as many tokens as its constrained twin
(ignore_eos, max_tokens = that length), so both runs have the same batch at every step
and differ only by the masks. On the qwen3-36m benchmark preset; prints output tokens/s
of both and their ratio; the grammar is compiled (and cached) before the timed runs.

    python scripts/bench_structured.py [--num-seqs 64] [--tp 1]
"""

from __future__ import annotations

import argparse
import time

from nvllm import LLM, SamplingParams
from nvllm.launch.tiny import ensure_tiny_checkpoint

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 6},
    "score": {"type": "integer"}, "ok": {"type": "boolean"}},
    "required": ["name", "tags", "score", "ok"], "additionalProperties": False}


def run(llm: LLM, prompts: list[str], params) -> tuple[float, list[int]]:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    assert all(o.error is None for o in outs)
    return dt, [len(o.token_ids) for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-seqs", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    model = str(ensure_tiny_checkpoint("qwen3-36m"))
    prompts = [f"Describe item {i} as JSON:" for i in range(a.num_seqs)]
    held = SamplingParams(temperature=0.0, max_tokens=a.max_tokens,
                          structured_outputs={"json": SCHEMA})
    with LLM(model, device="cpu", tensor_parallel_size=a.tp) as llm:
        _, lengths = run(llm, prompts, held)  # compiles the grammar; the lengths to match
        free = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                for n in lengths]
        rates: dict[str, list[float]] = {"free": [], "json": []}
        for _ in range(a.rounds):
            for name, params in (("free", free), ("json", held)):
                dt, got = run(llm, prompts, params)
                assert got == lengths
                n = sum(got)
                rates[name].append(n / dt)
                print(f"{name:5s} {n:6d} output tokens in {dt:6.2f} s = {n / dt:8.1f} tok/s")
    med = {k: sorted(v)[len(v) // 2] for k, v in rates.items()}
    print(f"structured/free output tok/s: {med['json'] / med['free']:.2f}x "
          f"[json {med['json']:.0f} vs free {med['free']:.0f} tok/s, medians of {a.rounds}]")


if __name__ == "__main__":
    main()
