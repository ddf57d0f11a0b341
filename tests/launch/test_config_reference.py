"""docs/configuration.md is generated from EngineConfig and nvllm-launch's options, and
stays so: a field added, renamed or re-documented without rerunning the generator fails
here with the command that fixes it."""

from __future__ import annotations

import dataclasses

from nvllm.common.config import EngineConfig
from nvllm.launch import config_reference
from nvllm.launch.options import NOT_OPTIONS


def test_configuration_md_is_up_to_date():
    text = config_reference.render()
    doc = config_reference.DOC
    current = doc.read_text() if doc.is_file() else ""
    assert current == text, (
        f"{doc.relative_to(config_reference.ROOT)} is stale: run "
        f"`PYTHONPATH=. {config_reference.COMMAND}` and commit the result")


def test_every_engine_field_has_a_row():
    text = config_reference.render()
    for f in dataclasses.fields(EngineConfig):
        if f.name not in NOT_OPTIONS:
            assert f"| `{f.name}` | `--" in text, f.name


def test_row_shows_flags_default_and_choices():
    rows = {line.split(" | ")[0]: line for line in config_reference.render().splitlines()
            if line.startswith("| `")}
    assert "`--tp`, `--tensor-parallel-size` | `1` |" in rows["| `tensor_parallel_size`"]
    assert "`--async-scheduling`, `--no-async-scheduling` | on |" in rows[
        "| `async_scheduling`"]
    assert "| `--enforce-eager` | off |" in rows["| `enforce_eager`"]
    assert "`auto`, `cpu`, `cuda`" in rows["| `device`"]


def test_check_mode_reports_a_stale_file(tmp_path, monkeypatch, capsys):
    stale = tmp_path / "configuration.md"
    stale.write_text("old\n")
    monkeypatch.setattr(config_reference, "DOC", stale)
    monkeypatch.setattr(config_reference, "ROOT", tmp_path)
    assert config_reference.main(["--check"]) == 1
    assert config_reference.COMMAND in capsys.readouterr().err
    assert config_reference.main([]) == 0
    assert config_reference.main(["--check"]) == 0
