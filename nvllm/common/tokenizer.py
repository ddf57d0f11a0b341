"""``open_tokenizer``: the leader's tokenizer, without torch where the folder allows.

Why: transformers 5 imports torch when AutoTokenizer is first used (about 250 MiB of RSS
in a process that otherwise never touches a tensor: the leader). A folder whose
tokenizer is transformers' generic one (``tokenizer_class`` TokenizersBackend or
PreTrainedTokenizerFast in ``tokenizer_config.json``) is nothing but the ``tokenizers``
library's ``tokenizer.json`` plus special-token names: its ``__call__`` is the backend's
``encode(text, add_special_tokens=True)`` and its ``decode`` the backend's, with
transformers' clean-up of spaces only when the config asks for it. ``FastTokenizer``
is exactly that, and ``tests/common/test_tokenizer.py`` checks it against AutoTokenizer on
every tokenizer the tests have. Any other folder (a model tokenizer class with its own
rules, ``add_bos_token`` / ``add_eos_token`` overrides, clean-up asked for, a
SentencePiece-only folder) opens through AutoTokenizer, as before.

Chat templates: ``apply_chat_template`` renders with transformers' own torch-free
functions (``render_jinja_template``, the same message normalization), with the template
of ``tokenizer_config.json`` or ``chat_template.jinja`` and the special tokens as
template variables, as transformers does; the HTTP gateway renders chats with it.
"""

from __future__ import annotations

import copy
import json
import pathlib
from dataclasses import dataclass
from typing import Any

GENERIC_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})
# tokenizer_config.json keys by which transformers changes what the backend does.
_CHANGES_BACKEND = ("add_bos_token", "add_eos_token", "add_prefix_space", "legacy",
                    "do_lower_case", "spaces_between_special_tokens")


@dataclass(slots=True)
class Encoding:
    """What ``tokenizer(text)`` returns: ``.input_ids``, or ``["input_ids"]`` as on
    transformers' BatchEncoding."""

    input_ids: list[int]

    def __getitem__(self, key: str) -> list[int]:
        if key != "input_ids":
            raise KeyError(key)
        return self.input_ids


class FastTokenizer:
    """The generic fast tokenizer of a folder, on ``tokenizers`` alone (see the module
    docstring for when ``open_tokenizer`` picks it)."""

    clean_up_tokenization_spaces = False
    # Every method only reads the Rust tokenizer (encode / decode take it by shared
    # reference), so one instance serves the leader's threads without a copy (~23 MiB
    # for SmolLM2's 49k vocabulary).
    shared_across_threads = True

    def __init__(self, folder: str | pathlib.Path, config: dict[str, Any]) -> None:
        from tokenizers import Tokenizer

        self.folder = str(folder)
        self.backend_tokenizer = Tokenizer.from_file(str(pathlib.Path(folder) /
                                                         "tokenizer.json"))
        self.name_or_path = self.folder
        self.special_tokens_map = {k: v for k in SPECIAL_TOKEN_KEYS
                                   if (v := _token_name(config.get(k))) is not None}
        self.chat_template = _chat_template(pathlib.Path(folder), config)

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens_map.get("eos_token")

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens_map.get("bos_token")

    @property
    def unk_token_id(self) -> int | None:
        unk = self.special_tokens_map.get("unk_token")
        return None if unk is None else self.backend_tokenizer.token_to_id(unk)

    def __call__(self, text: str, add_special_tokens: bool = True) -> Encoding:
        return Encoding(self.encode(text, add_special_tokens))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend_tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | None | list[int | None]:
        if isinstance(tokens, str):
            return self.backend_tokenizer.token_to_id(tokens)
        return [self.backend_tokenizer.token_to_id(t) for t in tokens]

    def convert_ids_to_tokens(self, ids: int | list[int]) -> str | None | list[str | None]:
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        return [self.backend_tokenizer.id_to_token(int(i)) for i in ids]

    def apply_chat_template(self, conversation: list[dict[str, Any]], tools: list | None = None,
                            documents: list | None = None, chat_template: str | None = None,
                            add_generation_prompt: bool = False,
                            continue_final_message: bool = False, tokenize: bool = True,
                            **kwargs: Any) -> str | list[int]:
        """transformers' apply_chat_template for one conversation (text, or its ids
        without added special tokens)."""
        from transformers.tokenization_utils_base import _normalize_chat_messages
        from transformers.utils.chat_template_utils import render_jinja_template

        template = chat_template or self.chat_template
        if not template:
            raise ValueError("the tokenizer has no chat template and none was given")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt are not "
                             "compatible")
        rendered, _ = render_jinja_template(
            conversations=[_normalize_chat_messages(conversation)], tools=tools,
            documents=documents, chat_template=template,
            continue_final_message=continue_final_message,
            add_generation_prompt=add_generation_prompt,
            **{**self.special_tokens_map, **kwargs})
        text = rendered[0]
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def __deepcopy__(self, memo: dict) -> FastTokenizer:
        # A copy per thread (the server's tokenizing thread): the Rust tokenizer is
        # cloned through its JSON, the rest is immutable and shared.
        from tokenizers import Tokenizer

        other = copy.copy(self)
        other.backend_tokenizer = Tokenizer.from_str(self.backend_tokenizer.to_str())
        return other


SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                      "cls_token", "mask_token")


def _chat_template(folder: pathlib.Path, config: dict[str, Any]) -> str | None:
    """The folder's one chat template: tokenizer_config.json's, else chat_template.jinja's,
    else chat_template.json's (transformers' order)."""
    if isinstance(config.get("chat_template"), str):
        return config["chat_template"]
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text()
    if (folder / "chat_template.json").is_file():
        t = json.loads((folder / "chat_template.json").read_text()).get("chat_template")
        return t if isinstance(t, str) else None
    return None


def _token_name(value: Any) -> str | None:
    if isinstance(value, dict):  # an AddedToken written out
        return value.get("content")
    return value if isinstance(value, str) else None


def generic_config(folder: str | pathlib.Path) -> dict[str, Any] | None:
    """tokenizer_config.json of `folder` when FastTokenizer reproduces its tokenizer
    exactly, else None."""
    d = pathlib.Path(folder)
    try:
        config = json.loads((d / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    if not (d / "tokenizer.json").is_file() or not isinstance(config, dict):
        return None
    if config.get("tokenizer_class") not in GENERIC_CLASSES:
        return None
    if any(key in config for key in _CHANGES_BACKEND):
        return None
    if config.get("clean_up_tokenization_spaces"):
        return None
    # Named templates (a dict, or a folder of them) choose by tools and names: transformers'.
    if "chat_template" in config and not isinstance(config["chat_template"], str | None):
        return None
    if (d / "additional_chat_templates").exists():
        return None
    return config


def open_tokenizer(folder: str | pathlib.Path, *, light: bool = True) -> Any:
    """The tokenizer of a local folder: FastTokenizer where it is exact (and `light`),
    else transformers' AutoTokenizer."""
    config = generic_config(folder) if light else None
    if config is not None:
        return FastTokenizer(folder, config)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))
