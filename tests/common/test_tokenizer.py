"""nvllm/common/tokenizer.py: FastTokenizer encodes and decodes exactly as transformers'
AutoTokenizer on every tokenizer folder the tests have (the tiny presets' BPE, the tool
tokenizer, the real SmolLM2's converted from its GGUF), and open_tokenizer falls back to
AutoTokenizer wherever the folder's config changes what the backend does. The leader
then never imports torch (checked in a fresh process)."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys

import pytest

from nvllm.common.tokenizer import FastTokenizer, generic_config, open_tokenizer
from nvllm.launch.tiny import ensure_tiny_checkpoint

TEXTS = [
    "", " ", "Hello world, how are you?", "  leading and trailing  ", "tabs\tand\nnewlines\n\n",
    "unicode: naïve café — 日本語 🙂 ℝ", "<|im_start|>user\nhi<|im_end|>\n", "<|endoftext|>x",
    "def f(x):\n    return x ** 2  # ok", "1234567890 3.14159 -0.5e-3", "a" * 300,
    "don't won't y'all", "<|im_end|><|im_end|>", "\u00a0nbsp\u200bzero-width",
]


def _folders(smollm2: str | None) -> list[str]:
    out = [str(ensure_tiny_checkpoint(p)) for p in ("qwen3", "qwen3-tools", "llama")]
    if smollm2 is not None:
        from nvllm.common.model_source import resolve_model_source

        out.append(resolve_model_source(smollm2, None).tokenizer)
    return out


@pytest.fixture(scope="module")
def folders(smollm2) -> list[str]:
    return _folders(smollm2)


def test_fast_tokenizer_equals_autotokenizer(folders):
    from transformers import AutoTokenizer

    for folder in folders:
        assert generic_config(folder) is not None, folder
        fast, hf = open_tokenizer(folder), AutoTokenizer.from_pretrained(folder)
        assert isinstance(fast, FastTokenizer)
        assert fast.eos_token == hf.eos_token and fast.bos_token == hf.bos_token, folder
        assert len(fast) == len(hf), folder
        for text in TEXTS:
            ids = hf(text).input_ids
            assert fast(text).input_ids == ids, (folder, text)
            assert fast.encode(text, add_special_tokens=False) == hf.encode(
                text, add_special_tokens=False), (folder, text)
            for skip in (False, True):
                assert fast.decode(ids, skip) == hf.decode(ids, skip_special_tokens=skip)
        specials = sorted(hf.all_special_ids)
        for ids in ([*specials, 5, 6, 7], list(range(0, 300, 7)), [min(len(hf) - 1, 9999)]):
            for skip in (False, True):
                assert fast.decode(ids, skip) == hf.decode(ids, skip_special_tokens=skip), \
                    (folder, ids, skip)
        assert fast.special_tokens_map == hf.special_tokens_map, folder
        assert fast.unk_token_id == hf.unk_token_id, folder
        assert fast.chat_template == hf.chat_template, folder
        assert fast.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids), folder
        assert fast.convert_ids_to_tokens(ids[0]) == hf.convert_ids_to_tokens(ids[0])
        assert fast.convert_tokens_to_ids("<|im_end|>") == hf.convert_tokens_to_ids("<|im_end|>")
        twin = copy.deepcopy(fast)
        assert twin is not fast and twin("Hello world").input_ids == fast("Hello world").input_ids


CHATS = [
    ([{"role": "user", "content": "What is 2+2?"}], {"add_generation_prompt": True}),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
      {"role": "assistant", "content": "Hello", "tool_calls": None}], {}),
    ([{"role": "user", "content": "Go on"}, {"role": "assistant", "content": "Once upon"}],
     {"continue_final_message": True}),
    ([{"role": "user", "content": "weather?"}],
     {"add_generation_prompt": True, "tools": [{"type": "function", "function": {
         "name": "get_weather", "description": "d", "parameters": {
             "type": "object", "properties": {"city": {"type": "string"}}}}}]}),
    ([{"role": "user", "content": "x"}], {"chat_template": "{{ bos_token }}{% for m in "
                                          "messages %}[{{ m.content }}]{% endfor %}{{ flag }}",
                                          "flag": "!"}),
]


def test_chat_templates_render_as_transformers_renders_them(folders):
    from transformers import AutoTokenizer

    from nvllm.common.chat import chat_prompt_ids

    for folder in folders:
        fast, hf = open_tokenizer(folder), AutoTokenizer.from_pretrained(folder)
        if not hf.chat_template:
            continue
        for messages, options in CHATS:
            want = hf.apply_chat_template(messages, tokenize=False, **options)
            assert fast.apply_chat_template(messages, tokenize=False, **options) == want, \
                (folder, messages, options)
        msgs = CHATS[0][0]
        assert chat_prompt_ids(fast, msgs) == chat_prompt_ids(hf, msgs), folder


@pytest.mark.parametrize("change", [{"add_bos_token": True}, {"tokenizer_class": "LlamaTokenizer"},
                                    {"clean_up_tokenization_spaces": True}])
def test_configs_that_change_the_backend_open_through_autotokenizer(tmp_path, change):
    src = ensure_tiny_checkpoint("qwen3")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, **change}))
    assert generic_config(tmp_path) is None
    if "tokenizer_class" not in change:
        assert not isinstance(open_tokenizer(tmp_path), FastTokenizer)


def test_the_leader_tokenizer_does_not_import_torch():
    folder = str(ensure_tiny_checkpoint("qwen3"))
    code = ("import sys; from nvllm.common.tokenizer import open_tokenizer; "
            f"t = open_tokenizer({folder!r}); t('hi'); t.decode([1, 2]); "
            "import nvllm.leader.server; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == "False", out.stdout + out.stderr


def test_one_fast_tokenizer_serves_threads_at_once(folders):
    # The leader's tokenizing thread shares the engine's FastTokenizer (no copy): encode and
    # decode from several threads at once give what one thread gives.
    import threading

    for folder in folders:
        fast = open_tokenizer(folder)
        if not isinstance(fast, FastTokenizer):
            continue
        assert fast.shared_across_threads
        text = "The quick brown fox, 1234 times, jumps over the lazy dog. " * 20
        ids = fast(text).input_ids
        words = fast.decode(ids)
        bad: list[str] = []

        def work(fast=fast, text=text, ids=ids, words=words, bad=bad, folder=folder) -> None:
            for _ in range(200):
                if fast(text).input_ids != ids or fast.decode(ids) != words:
                    bad.append(folder)

        threads = [threading.Thread(target=work) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not bad


def test_resolving_a_gguf_file_does_not_import_transformers(smollm2):
    # Once its metadata is converted (the fixture's folder), resolving the file again (the
    # leader and each worker do) reads the cache: transformers' import is ~37 MiB of RSS.
    from nvllm.common.model_source import resolve_model_source

    resolve_model_source(smollm2, None)
    code = ("import sys; from nvllm.common.model_source import resolve_model_source; "
            f"s = resolve_model_source({smollm2!r}, None); "
            "print(s.tokenizer, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip().endswith(" False"), out.stdout + out.stderr
