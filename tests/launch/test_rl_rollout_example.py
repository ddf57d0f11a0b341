"""scripts/rl_rollout_example.py runs its loop end to end (rollouts through AsyncClient,
a level-2 sleep while the trainer steps, every weight pushed back, the wake) and prints
each step's reward; whether the reward rises is for the full run (docs/rl.md), not for
one tiny step."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_rl_rollout_example_runs_and_reports_rewards(tiny):
    cmd = [sys.executable, str(REPO / "scripts" / "rl_rollout_example.py"),
           "--model", tiny("qwen3"), "--steps", "1", "--prompts", "2", "--n", "3",
           "--max-tokens", "4", "--sleep-level", "2"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    steps = re.findall(r"^step (\d+): mean reward ([\d.]+) .*weights now version (\d+), "
                       r"slept at level 2 freeing [\d.]+ MiB\)$", r.stdout, re.M)
    assert [(int(s), int(v)) for s, _, v in steps] == [(0, 1)], r.stdout
    final = re.search(r"^after 1 steps: mean reward ([\d.]+) \(started at ([\d.]+)\)$",
                      r.stdout, re.M)
    assert final is not None, r.stdout
    assert all(0 <= float(x) <= 1 for x in [m for _, m, _ in steps] + list(final.groups()))
    assert float(final.group(2)) == float(steps[0][1])
