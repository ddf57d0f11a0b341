"""SpeculativeConfig: vLLM's keys and defaults, every field checked by name."""

from __future__ import annotations

import json
import pathlib

import pytest

from nvllm.common.speculative import SpeculativeConfig


def test_defaults_as_vllm():
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)
    c = SpeculativeConfig.from_dict({"num_speculative_tokens": 3, "prompt_lookup_max": 4})
    assert (c.method, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 4, 4)
    c = SpeculativeConfig.from_dict('{"prompt_lookup_min": 2, "prompt_lookup_max": 4}')
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (2, 4)
    assert SpeculativeConfig.from_dict(c.to_dict()) == c


@pytest.mark.parametrize("d,match", [
    ({"num_speculative_tokens": 0}, r"num_speculative_tokens must be an integer in 1\.\.16"),
    ({"num_speculative_tokens": 17}, r"num_speculative_tokens must be an integer in 1\.\.16"),
    ({"num_speculative_tokens": True}, r"num_speculative_tokens"),
    ({"prompt_lookup_min": 0}, r"prompt_lookup_min must be an integer in 1\.\.64"),
    ({"prompt_lookup_max": 65}, r"prompt_lookup_max must be an integer in 1\.\.64"),
    ({"prompt_lookup_min": 4, "prompt_lookup_max": 2}, r"prompt_lookup_min \(4\) must be <="),
    ({"disable_by_batch_size": 0}, r"disable_by_batch_size must be an integer >= 1"),
    ({"full_k_batch_size": 0}, r"full_k_batch_size must be an integer >= 1"),
    ({"min_acceptance_rate": 1.5}, r"min_acceptance_rate must be a number in 0\.\.1"),
    ({"retry_after_tokens": -1}, r"retry_after_tokens must be an integer >= 0"),
    ({"lookup_window": 3}, r"lookup_window must be an integer in 6\.\."),
    ({"method": "eagle"}, r"method must be one of \['ngram', 'draft_model'\]"),
    ({"bogus": 1}, r"unknown key\(s\) \['bogus'\]"),
    ({"method": "draft_model"}, r"model must be the draft model's checkpoint path"),
    ({"method": "ngram", "model": "/x"}, r"method 'ngram' takes no model"),
    ("{not json", r"not valid JSON"),
    ([1, 2], r"must be a map"),
])
def test_errors_name_the_field_and_limit(d, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.from_dict(d)


def test_k_falls_with_batch_size_and_turns_off():
    c = SpeculativeConfig(num_speculative_tokens=4, full_k_batch_size=8,
                          disable_by_batch_size=32)
    assert [c.k_for(n) for n in (1, 8, 16, 32, 33)] == [4, 4, 2, 1, 0]


def test_engine_config_takes_a_map_or_json(tiny):
    from nvllm.common.config import EngineConfig

    c = EngineConfig(model=tiny("llama"), speculative_config='{"num_speculative_tokens": 2}')
    c.finalize()
    assert c.speculative_config.num_speculative_tokens == 2
    d = c.to_dict()
    assert d["speculative_config"]["num_speculative_tokens"] == 2
    with pytest.raises(ValueError, match="unknown key"):
        EngineConfig(model=tiny("llama"), speculative_config={"k": 2}).finalize()


def test_a_model_means_a_draft_model(tiny):
    from nvllm.common.config import EngineConfig

    c = SpeculativeConfig.from_dict({"model": "/some/draft", "num_speculative_tokens": 2})
    assert c.method == "draft_model" and c.uses_draft_model
    e = EngineConfig(model=tiny("llama"), speculative_config=json.dumps(
        {"model": tiny("llama"), "num_speculative_tokens": 3})).finalize()
    assert e.speculative_config.method == "draft_model"
    assert e.speculative_config.model == str(pathlib.Path(tiny("llama")).resolve())
    # the workers rebuild it from the config's dict form
    assert SpeculativeConfig.from_dict(e.to_dict()["speculative_config"]) == e.speculative_config


def test_a_draft_with_another_vocabulary_is_refused(tiny, tmp_path):
    """Checked at start-up (EngineConfig.finalize, before any worker starts), naming both
    sizes."""
    from nvllm.common.config import EngineConfig

    cfg = json.loads((pathlib.Path(tiny("llama")) / "config.json").read_text())
    assert cfg["vocab_size"] == 1024
    cfg["vocab_size"] = 2048
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"draft model's vocabulary has 2048 tokens but the "
                                         r"target's has 1024"):
        EngineConfig(model=tiny("llama"), speculative_config={
            "model": str(tmp_path), "num_speculative_tokens": 2}).finalize()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        EngineConfig(model=tiny("llama"), speculative_config={
            "model": str(tmp_path / "missing"), "num_speculative_tokens": 2}).finalize()


def test_a_sliding_target_needs_a_draft_within_its_window(tiny):
    """The leader frees blocks behind a sliding target's window; a full-attention draft
    would read them."""
    from nvllm.common.config import EngineConfig

    with pytest.raises(ValueError, match=r"the draft model must slide too, by at most 32"):
        EngineConfig(model=tiny("mistral-sw"), speculative_config={
            "model": tiny("mistral"), "num_speculative_tokens": 2}).finalize()
    EngineConfig(model=tiny("mistral-sw"), speculative_config={
        "model": tiny("mistral-sw"), "num_speculative_tokens": 2}).finalize()
