"""What a request's output must match (vLLM's ``StructuredOutputsParams``): a JSON schema,
any JSON object, a regular expression, an EBNF grammar, or one of a list of strings.

Exactly one is set. The spec is plain data that travels on the client wire; the leader
compiles it (``nvllm/leader/grammar.py``) and rank 0 enforces it token by token
(``nvllm/worker/structured_output.py``). A JSON schema given as a dict is kept as compact
JSON text, in the order its keys were given (the order a model writes the properties).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import xxhash

from nvllm.common.utils import shown

KINDS = ("json", "json_object", "regex", "grammar", "choice")


@dataclass(slots=True)
class StructuredOutputsParams:
    json: str | dict | None = None  # a JSON schema (dict or JSON text)
    json_object: bool = False  # any JSON object
    regex: str | None = None
    grammar: str | None = None  # EBNF, in xgrammar's (GBNF-like) syntax; the rule `root`
    choice: list[str] | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"structured_outputs.{name}: {why} (got "
                              f"{shown(getattr(self, name))})")

        if isinstance(self.json, dict):
            try:
                self.json = json.dumps(self.json, separators=(",", ":"), ensure_ascii=False,
                                       allow_nan=False)
            except RecursionError:
                raise bad("json", "is nested too deeply") from None
            except (TypeError, ValueError):
                raise bad("json", "must be a JSON schema (a JSON object)") from None
        if self.json is not None:
            if not isinstance(self.json, str):
                raise bad("json", "must be a JSON schema (a JSON object or its text)")
            try:
                schema = json.loads(self.json)
            except RecursionError:
                raise bad("json", "is nested too deeply") from None
            except ValueError:
                raise bad("json", "is not valid JSON text") from None
            if not isinstance(schema, (dict, bool)):
                raise bad("json", "must be a JSON schema (a JSON object)")
        if not isinstance(self.json_object, bool):
            raise bad("json_object", "must be a bool")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise bad(name, "must be a non-empty string")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise bad("choice", "must be a non-empty list of non-empty strings")
            self.choice = list(self.choice)
        set_ = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            raise ValueError("structured_outputs: set exactly one of "
                             f"{', '.join(KINDS)} (got {len(set_)})")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def text(self) -> str:
        """The spec as one string: what its size limit counts and its cache key hashes."""
        kind = self.kind
        if kind == "json_object":
            return ""
        if kind == "choice":
            return json.dumps(self.choice, ensure_ascii=False)
        return getattr(self, kind)

    def key(self, variant: str = "") -> str:
        """A stable id of the compiled grammar (kind, text, and the compile options)."""
        h = xxhash.xxh3_128_hexdigest(f"{self.kind}\0{variant}\0{self.text}".encode())
        return f"{self.kind}-{h}"

    def to_dict(self) -> dict[str, Any]:
        """Only the field that is set (what travels on the wire)."""
        kind = self.kind
        return {kind: getattr(self, kind)}

    @classmethod
    def from_any(cls, v: Any) -> StructuredOutputsParams | None:
        if v is None or isinstance(v, cls):
            return v
        if not isinstance(v, dict):
            raise ValueError("structured_outputs must be a map with one of "
                             f"{', '.join(KINDS)}")
        unknown = [k for k in v if k not in KINDS]
        if unknown:
            raise ValueError("structured_outputs: unknown field(s) "
                             + ", ".join(repr(k) if isinstance(k, str) and len(k) <= 40
                                         else shown(k) for k in unknown[:3])
                             + f"; expected one of {', '.join(KINDS)}")
        return cls(**v)
