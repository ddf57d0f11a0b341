"""A tiny RL loop against nvllm: a REINFORCE trainer (torch on CPU, HF's model class)
and an engine that serves its rollouts, the policy's weights pushed into the engine
after every step, as an RL framework (verl, OpenRLHF) drives vLLM.

The toy reward is the fraction of a rollout's tokens that fall in the first eighth of
the vocabulary (about 1/8 for the random tiny model); the printed mean reward rises as
the policy learns to emit them. Each step:

1. rollouts: prompts x n samples at temperature 1 through ``AsyncClient`` (the engine
   runs in this process, served on a ZMQ endpoint, its workers in their own);
2. optionally ``sleep(level)``: the engine frees its KV cache (and at level 2 its
   weights) while the trainer trains;
3. a policy-gradient step: the log-probability of each sampled completion under the
   policy, weighted by its reward minus the mean of its prompt's group (as GRPO does);
4. ``update_weights`` with every tensor (level 2 needs them all back; the engine then
   resumes by itself), ``wake_up`` the rest.

    python scripts/rl_rollout_example.py --steps 8          # about 30 s on 2 cores
    python scripts/rl_rollout_example.py --steps 3 --sleep-level 2
"""

from __future__ import annotations

import argparse
import asyncio
import pathlib
import tempfile
import time

import torch

from nvllm import LLM, AsyncClient, SamplingParams
from nvllm.launch.tiny import ensure_tiny_checkpoint
from nvllm.leader.server import EngineServer


def reward(tokens: list[int], vocab_size: int) -> float:
    """The fraction of `tokens` in the first eighth of the vocabulary."""
    return sum(t < vocab_size // 8 for t in tokens) / max(1, len(tokens))


async def rollouts(client: AsyncClient, prompts: list[list[int]], n: int, max_tokens: int
                   ) -> list[list[list[int]]]:
    """n sampled completions of every prompt, from the engine's current weights."""
    params = SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens, ignore_eos=True)
    outs = await asyncio.gather(*(client.generate(p, params) for p in prompts))
    return [[c.token_ids for c in o.outputs] for o in outs]


def policy_step(policy: torch.nn.Module, opt: torch.optim.Optimizer,
                prompts: list[list[int]], completions: list[list[list[int]]],
                rewards: list[list[float]]) -> None:
    """One REINFORCE step: raise the log-probability of completions that beat their
    group's mean reward, lower the others'."""
    seqs, advantages, starts = [], [], []
    for prompt, group, rs in zip(prompts, completions, rewards):
        r = torch.tensor(rs)
        adv = (r - r.mean()) / (r.std() + 1e-6)
        for comp, a in zip(group, adv.tolist()):
            seqs.append(prompt + comp)
            advantages.append(a)
            starts.append(len(prompt))
    width = max(len(s) for s in seqs)
    ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
    logp = torch.log_softmax(policy(ids).logits[:, :-1].float(), -1)
    picked = logp.gather(-1, ids[:, 1:, None])[..., 0]
    mask = torch.zeros_like(picked)
    for i, (s, start) in enumerate(zip(seqs, starts)):
        mask[i, start - 1:len(s) - 1] = 1.0  # the completion's tokens only
    seq_logp = (picked * mask).sum(-1)
    loss = -(torch.tensor(advantages) * seq_logp).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


async def train(endpoint: str, model_dir: str, args: argparse.Namespace) -> list[float]:
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from nvllm.common.model_source import safetensors_files

    torch.manual_seed(args.seed)
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    vocab = policy.config.vocab_size
    names = set()  # what the checkpoint holds (a tied head is not a tensor of its own)
    for f in safetensors_files(model_dir):
        with safe_open(str(f), "pt") as st:
            names.update(st.keys())
    opt = torch.optim.Adam(policy.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(vocab // 8, vocab, (6,), generator=gen).tolist()
               for _ in range(args.prompts)]
    client = AsyncClient(endpoint, timeout_s=120)
    means = []
    try:
        for step in range(args.steps):
            t0 = time.perf_counter()
            completions = await rollouts(client, prompts, args.n, args.max_tokens)
            rewards = [[reward(c, vocab) for c in group] for group in completions]
            means.append(sum(map(sum, rewards)) / sum(map(len, rewards)))
            if args.sleep_level:
                freed = await client.sleep(level=args.sleep_level)
            policy_step(policy, opt, prompts, completions, rewards)
            if args.sleep_level:
                await client.wake_up(tags=["weights"])
            state = {k: v.detach() for k, v in policy.state_dict().items() if k in names}
            version = await client.update_weights(state, weight_version=step + 1)
            if args.sleep_level:
                await client.wake_up()  # the KV cache, and generation resumes
            slept = (f", slept at level {args.sleep_level} freeing "
                     f"{(freed.weights_bytes + freed.kv_cache_bytes) / 2**20:.1f} MiB"
                     if args.sleep_level else "")
            print(f"step {step}: mean reward {means[-1]:.3f} ({time.perf_counter() - t0:.1f}"
                  f" s; weights now version {version}{slept})", flush=True)
        completions = await rollouts(client, prompts, args.n, args.max_tokens)
        final = [reward(c, vocab) for group in completions for c in group]
        means.append(sum(final) / len(final))
        print(f"after {args.steps} steps: mean reward {means[-1]:.3f} (started at "
              f"{means[0]:.3f})", flush=True)
    finally:
        client.close()
    return means


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="an HF checkpoint folder (default: the "
                    "tiny Qwen3 preset)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--n", type=int, default=16, help="samples per prompt")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-2)
    ap.add_argument("--sleep-level", type=int, choices=(0, 1, 2), default=0,
                    help="sleep the engine during each training step (0: never)")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(ensure_tiny_checkpoint("qwen3", pathlib.Path(tmp)))
        llm = LLM(model, tensor_parallel_size=args.tp, device="cpu", dtype="float32",
                  cpu_kv_cache_gib=0.05, seed=args.seed)
        server = EngineServer(llm.engine)
        import threading

        stop = threading.Event()
        thread = threading.Thread(target=server.serve, args=(stop,), daemon=True)
        thread.start()
        try:
            asyncio.run(train(server.endpoint, model, args))
        finally:
            stop.set()
            thread.join(30)
            server.close()
            llm.shutdown()


if __name__ == "__main__":
    main()
