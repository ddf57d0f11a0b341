"""``nvllm-launch --demo``: show a model answering.

A chat model (its tokenizer has a chat template) is asked a few questions one at a time,
each answer streamed as the engine produces it, as a person at a terminal would see it;
then all of them again as one batch, for the throughput line. A model without a chat
template (the tiny random checkpoints' text is gibberish anyway) gets plain completions.
"""

from __future__ import annotations

import logging
import time

import click

from nvllm.common.chat import chat_prompt_ids
from nvllm.common.sampling_params import SamplingParams
from nvllm.leader.engine import LLMEngine

DEMO_PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "A tensor-parallel inference engine splits every layer",
    "List three prime numbers:",
]

DEMO_QUESTIONS = [
    "What is the capital of France?",
    "Give me three short tips for a good night's sleep.",
    "Write a haiku about the sea.",
    "What is 12 times 7?",
    "In two sentences, what does a GPU do?",
]


def run_demo(engine: LLMEngine, max_tokens: int, temperature: float) -> None:
    """Stream an answer to each of DEMO_QUESTIONS, then time them as one batch."""
    from nvllm import LLM

    llm = LLM.from_engine(engine)
    if not getattr(engine.tokenizer, "chat_template", None):
        generate_and_report(engine, DEMO_PROMPTS, max_tokens, temperature)
        return
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens)
    conversations = [[{"role": "user", "content": q}] for q in DEMO_QUESTIONS]
    prompts = [chat_prompt_ids(engine.tokenizer, c) for c in conversations]
    stats = logging.getLogger("nvllm.leader.stats")
    level = stats.level
    stats.setLevel(logging.WARNING)  # its periodic line would land inside the answers
    try:
        for question, ids in zip(DEMO_QUESTIONS, prompts):
            click.echo(click.style(f"\n> {question}", bold=True))
            _stream(engine, ids, params)
    finally:
        stats.setLevel(level)
    click.echo(click.style(f"\nAll {len(prompts)} questions again, as one batch:", bold=True))
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
    _throughput(outs, time.perf_counter() - t0)


def _stream(engine: LLMEngine, prompt_ids: list[int], params: SamplingParams) -> None:
    """Generate for one prompt alone, echoing each delta's text as it arrives."""
    req = engine.submit(None, params, prompt_token_ids=prompt_ids)
    reason = None
    while engine.has_unfinished_requests():
        for d in engine.step().deltas:
            if d.request_id == req.request_id:
                click.echo(d.text, nl=False)
                reason = d.finish_reason or reason
    click.echo(click.style(f"  [{reason}]", dim=True))


def generate_and_report(engine: LLMEngine, prompts: list[str], max_tokens: int,
                        temperature: float) -> None:
    """Generate for `prompts` as one batch and print the texts and the throughput."""
    from nvllm import LLM

    params = SamplingParams(temperature=temperature, max_tokens=max_tokens)
    t1 = time.perf_counter()
    outs = LLM.from_engine(engine).generate(prompts, params)
    dt = time.perf_counter() - t1
    for out in outs:
        click.echo(f"\n--- {out.prompt!r}")
        if out.error:
            click.echo(f"[error] {out.error}")
        else:
            click.echo(f"{out.text!r}  ({len(out.token_ids)} tokens, {out.finish_reason})")
    _throughput(outs, dt)


def _throughput(outs, dt: float) -> None:
    n_out = sum(len(o.token_ids) for o in outs)
    n_in = sum(len(o.prompt_token_ids) for o in outs)
    click.echo(f"\n{len(outs)} requests, {n_in} prompt + {n_out} generated tokens in "
               f"{dt:.2f}s: {n_out / dt:.1f} output tok/s, "
               f"{(n_in + n_out) / dt:.1f} total tok/s")
