"""nvllm/common/model_source.py: a GGUF file's metadata is converted in a child process,
so the process that first meets the file (a serving leader) never imports transformers or
torch, and the child's errors reach the caller with their type and message."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import gguf
import numpy as np
import pytest

PROBE = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from nvllm.common.model_source import gguf_metadata_dir
    out = gguf_metadata_dir(Path(sys.argv[1]))
    json.dump({"dir": str(out), "files": sorted(p.name for p in out.iterdir()),
               "imported": sorted(m for m in ("transformers", "torch") if m in sys.modules)},
              sys.stdout)
""")


def test_first_conversion_leaves_the_caller_free_of_transformers_and_torch(
        smollm2, tmp_path, monkeypatch):
    monkeypatch.setenv("NVLLM_GGUF_DIR", str(tmp_path / "cold"))  # a cold cache
    r = subprocess.run([sys.executable, "-c", PROBE, smollm2], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["imported"] == []
    assert str(tmp_path / "cold") in got["dir"]
    assert {"config.json", "tokenizer.json", "generation_config.json",
            "nvllm_gguf_source.json"} <= set(got["files"])
    assert not any(f.startswith(".conversion-error") for f in got["files"])
    # Nothing half-written is left beside it.
    assert [p.name for p in (tmp_path / "cold").iterdir()] == [got["dir"].rsplit("/", 1)[1]]


def test_an_unsupported_architecture_is_a_value_error_naming_it(tmp_path, monkeypatch):
    from nvllm.common import model_source

    monkeypatch.setenv("NVLLM_GGUF_DIR", str(tmp_path / "cache"))
    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"GGUF architecture 'gpt2' is not supported"):
        model_source.gguf_metadata_dir(path)
    assert list((tmp_path / "cache").iterdir()) == []  # the temporary folder is gone
