"""msgspec's validation errors as the client wire's errors: code, field path, limit.

msgspec says what was expected and where (``Expected `array` of length <= 3 - at
`$.params.stop_token_ids```); a client needs the field and the limit by the name its
operator sets (``params.stop_token_ids has more than 3 items (max_stop_token_ids is 3)``).
Messages never echo what the client sent: unknown keys are named only when they look like
a field name, and values never.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from nvllm.common.client_limits import INT64_MAX, INT64_MIN, ClientLimits

_AT = re.compile(r"^(?P<what>.*?)(?: - at `(?P<key>key` in `)?\$(?P<path>[^`]*)`)?$", re.S)
_PATH_INDEX = re.compile(r"\[[^\]]*\]")
# field (indices dropped) -> the ClientLimits field that bounds it.
_LIMIT_OF = {
    "id": "max_request_id_bytes",
    "prompt": "max_prompt_bytes",
    "prompt_token_ids": "max_model_len",
    "output_token_ids": "max_model_len",
    "token_ids": "max_model_len",  # detokenize
    "params.n": "max_n",
    "params.stop_token_ids": "max_stop_token_ids",
    "params.logit_bias": "max_logit_bias",
    **{f"params.structured_outputs.{k}": "max_grammar_bytes"
       for k in ("json", "regex", "grammar", "choice")},
}
# Sizes in bytes (the decoder counts characters, a sure sign of too many bytes).
_BYTE_LIMITS = {"max_request_id_bytes", "max_prompt_bytes", "max_grammar_bytes"}
_TYPE_NAMES = {"array": "a list", "object": "a map", "str": "a string", "int": "an integer",
               "float": "a number", "bool": "a bool", "null": "null", "bytes": "bytes"}
_FIXED = {  # fields whose error says more than its type
    "op": ("bad_op", "unknown op (expected one of abort, detokenize, health, info, metrics, "
                     "ping, submit, tokenize, or a weight, sleep or state message)"),
    "v": ("bad_version", "protocol version must be 1 (the leader speaks version 1)"),
    "stream": ("invalid_request", "'stream' must be true or absent: every request streams "
                                  "its outputs (collect them on the client)"),
    "ttl_ms": ("invalid_request", "ttl_ms must be a positive number or null"),
    "priority": ("invalid_request", "priority must be an integer in int64"),
}
# Token ids in the prompt: what the engine could never serve is `rejected`.
_REJECTED = {"prompt_token_ids"}
_NOT_SHOWN = "(its name is not shown)"


@dataclass(slots=True)
class FieldError(ValueError):
    """A field that breaks its type or limit: ``code`` to answer, ``field`` (a dotted
    path, "" for the frame itself) and a ``message`` that names both."""

    code: str
    field: str
    message: str

    def __str__(self) -> str:
        return self.message


def fixed_message(field: str) -> str:
    """The message for a field whose every error is one rule (ttl_ms, priority, ...)."""
    return _FIXED[field][1]


def field_error(text: str, limits: ClientLimits) -> FieldError:
    """The FieldError for msgspec's ValidationError text ``text``."""
    m = _AT.match(text)
    what, path = m["what"], (m["path"] or "").lstrip(".")
    field = _PATH_INDEX.sub("", path)
    if m["key"] and not field:
        return FieldError("bad_frame", "", "a message's keys must be strings")
    if m["key"]:  # a map key of the wrong type
        return FieldError("invalid_request", field,
                          f"{field}: keys must be {_expected_type(what)}")
    missing = re.match(r"Object missing required field `(\w+)`", what)
    if missing:
        name = missing[1]
        if name == "op":
            return FieldError("bad_op", "op", "a message needs an 'op'")
        return FieldError("invalid_request", name, f"{name!r} is required")
    unknown = re.match(r"Object contains unknown field `(.*)`$", what, re.S)
    if unknown:
        return _unknown(field, unknown[1])
    if field in _FIXED:
        code, message = _FIXED[field]
        return FieldError(code, field, message)
    if field == "" and "got `array`" in what:
        return FieldError("bad_frame", "", "a message must be a msgpack map")
    if field == "":
        return FieldError("bad_frame", "", "a message must be a msgpack map with an 'op'")
    return _bound(field, path, what, limits)


def _bound(field: str, path: str, what: str, limits: ClientLimits) -> FieldError:
    # A prompt the engine could never serve (too long, ids outside the vocabulary) is
    # `rejected`; one of the wrong type is a bad request.
    code = "rejected" if field in _REJECTED else "invalid_request"
    limit = _LIMIT_OF.get(field)
    if field == "params.stop":  # the list's length, or one string's characters
        limit = "max_stop_string_chars" if "str" in what else "max_stop_strings"
    size = re.match(r"Expected `(\w+)` of length <= (\d+)", what)
    if size:
        kind, n = size.groups()
        unit = ("bytes" if limit in _BYTE_LIMITS else "characters" if kind == "str"
                else "entries" if kind == "object" else "items")
        tail = f" ({limit} is {getattr(limits, limit)})" if limit else ""
        return FieldError(code, field, f"{path} has more than {n} {unit}{tail}")
    short = re.match(r"Expected `(\w+)` of length >= (\d+)", what)
    if short:
        kind, n = short.groups()
        unit = ("character" if kind == "str" else "item") + ("" if n == "1" else "s")
        return FieldError(code, field, f"{path} must have at least {n} {unit}")
    rng = re.match(r"Expected `(\w+)` (<=|>=|<|>) (\S+)", what)
    if rng:
        kind, op, n = rng.groups()
        if field in ("prompt_token_ids", "output_token_ids", "params.stop_token_ids",
                     "token_ids"):
            return FieldError(code, field, f"{path} is outside the vocabulary (token ids are "
                                           f"integers in [0, 2**63))")
        if n.lstrip("-").isdigit() and int(n) in (INT64_MAX, INT64_MIN):
            return FieldError(code, field, f"{path} must be an integer in int64")
        tail = f" ({limit} is {getattr(limits, limit)})" if limit else ""
        return FieldError(code, field, f"{path} must be {op} {n}{tail}")
    if what.startswith("Expected"):
        code = "invalid_request" if path == field else code
        return FieldError(code, field, f"{path} must be {_expected_type(what)}")
    return FieldError(code, field, f"{path}: {what}")


def _expected_type(what: str) -> str:
    """msgspec's ``Expected `int | str`, got `array``` as plain words."""
    m = re.match(r"Expected `([^`]*)`(?:, got `(\w+)`)?", what)
    if not m:
        return "another type"
    want = " or ".join(_TYPE_NAMES.get(t.strip(), t.strip()) for t in m[1].split("|"))
    return want + (f", not {_TYPE_NAMES.get(m[2], m[2])}" if m[2] else "")


def _unknown(field: str, key: str) -> FieldError:
    shown = repr(key) if key.isidentifier() and len(key) <= 40 else _NOT_SHOWN
    if field == "params":
        return FieldError("invalid_request", "params", f"unknown sampling parameter {shown}")
    if field == "params.structured_outputs":
        return FieldError("invalid_request", field, f"structured_outputs: unknown field "
                          f"{shown}; expected one of json, json_object, regex, grammar, choice")
    return FieldError("invalid_request", field, f"{field}: unknown field {shown}")
