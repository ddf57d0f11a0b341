"""Engine options are generated from EngineConfig: every field has one, with its default."""

from __future__ import annotations

import dataclasses

import click
import pytest
from click.testing import CliRunner

from nvllm.common.config import EngineConfig
from nvllm.launch.bench import throughput
from nvllm.launch.cli import launch
from nvllm.launch.options import NOT_OPTIONS, engine_options

SETTINGS = [f for f in dataclasses.fields(EngineConfig) if f.name not in NOT_OPTIONS]


class Captured(Exception):
    """Raised by the stand-in build_engine, so launch stops before starting any worker."""


@pytest.fixture()
def llm_kwargs(monkeypatch):
    """Run nvllm-launch with build_engine replaced: returns the model and the other
    EngineConfig fields it was given."""
    seen = {}

    def fake_build(config, dist=None, serving=False):
        seen.update(model=config.model, dist=dist, kwargs={f.name: getattr(config, f.name)
                                                           for f in SETTINGS})
        raise Captured

    monkeypatch.setattr("nvllm.launch.engine_builder.build_engine", fake_build)
    monkeypatch.setattr("nvllm.common.proc.set_process_title", lambda title: None)

    def run(*args: str) -> tuple[str, dict]:
        res = CliRunner().invoke(launch, ["--model", "m", *args])
        assert isinstance(res.exception, Captured), res.output
        assert seen["dist"] is not None
        return seen["model"], seen["kwargs"]

    return run


def options_by_field(command: click.Command) -> dict[str, click.Option]:
    return {p.name: p for p in command.params if isinstance(p, click.Option)}


@pytest.mark.parametrize("command,skip", [(launch, ()), (throughput, ("seed",))])
def test_every_field_has_an_option_with_its_default(command, skip):
    opts = options_by_field(command)
    for f in SETTINGS:
        if f.name in skip:
            continue
        assert f.name in opts, f"{command.name} has no option for EngineConfig.{f.name}"
        assert opts[f.name].default == f.default, f.name
        assert "--" + f.name.replace("_", "-") in opts[f.name].opts, f.name


def test_defaults_build_the_default_config(llm_kwargs):
    model, kwargs = llm_kwargs()
    assert model == "m"
    assert EngineConfig(model="m", **kwargs) == EngineConfig("m")


def test_flags_reach_the_config(llm_kwargs):
    _, kwargs = llm_kwargs("--tp", "2", "--no-async-scheduling", "--max-num-seqs", "7")
    assert EngineConfig(model="m", **kwargs) == EngineConfig(
        "m", tensor_parallel_size=2, async_scheduling=False, max_num_seqs=7)


def test_aliases_and_choices(llm_kwargs):
    _, kwargs = llm_kwargs(
        "--tensor-parallel-size", "3", "--heartbeat-timeout", "1.5", "--step-timeout-s", "9",
        "--no-enable-prefix-caching", "--enforce-eager", "--restart-workers",
        "--device", "cpu", "--dtype", "bfloat16", "--attention-backend", "torch",
        "--max-model-len", "64", "--no-cpu-kv-mirror", "--seed", "5")
    assert {k: kwargs[k] for k in (
        "tensor_parallel_size", "heartbeat_timeout_s", "step_timeout_s",
        "enable_prefix_caching", "enforce_eager", "restart_workers", "device", "dtype",
        "attention_backend", "max_model_len", "cpu_kv_mirror", "seed")} == {
        "tensor_parallel_size": 3, "heartbeat_timeout_s": 1.5, "step_timeout_s": 9.0,
        "enable_prefix_caching": False, "enforce_eager": True, "restart_workers": True,
        "device": "cpu", "dtype": "bfloat16", "attention_backend": "torch",
        "max_model_len": 64, "cpu_kv_mirror": False, "seed": 5}
    res = CliRunner().invoke(launch, ["--model", "m", "--device", "tpu"])
    assert res.exit_code == 2 and "tpu" in res.output


def test_help_shows_defaults():
    res = CliRunner().invoke(launch, ["--help"])
    assert res.exit_code == 0
    assert "--heartbeat-timeout, --heartbeat-timeout-s FLOAT" in res.output
    assert "[default: 2048]" in res.output


def test_unknown_field_is_an_error():
    with pytest.raises(ValueError, match="not EngineConfig fields"):
        engine_options(exclude=("no_such_field",))
