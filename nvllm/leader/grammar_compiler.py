"""The grammar compiler process: ``python -m nvllm.leader.grammar_compiler``.

xgrammar compiles in C++ and cannot be interrupted, and a hostile schema or regex can make
a compile run long. So compiles run in this child of the leader, which the leader kills
when one passes its time limit (nvllm/leader/grammar.py); the step loop never waits on
one. The child builds xgrammar's ``TokenizerInfo`` once, from the tokenizer with the
model's vocabulary size (the config's, which may exceed the tokenizer's).

Frames on stdin/stdout: a 4-byte little-endian length, then msgpack (never pickle).
  first frame out:  [0, true, <TokenizerInfo JSON>, 0]
  in:               [job_id, kind, text, any_whitespace]
  out:              [job_id, ok, <CompiledGrammar JSON> or the error message, bytes]
The spec in ``argv[1]`` (JSON): tokenizer path, vocab_size, stop_token_ids, parent_pid.
"""

from __future__ import annotations

import json
import os
import struct
import sys
from typing import Any, BinaryIO

import msgpack

_LEN = struct.Struct("<I")
MAX_FRAME_BYTES = 1 << 30


def write_frame(f: BinaryIO, obj: Any) -> None:
    data = msgpack.packb(obj, use_bin_type=True)
    f.write(_LEN.pack(len(data)) + data)
    f.flush()


def read_frame(f: BinaryIO) -> Any:
    """The next frame, or None at end of stream."""
    head = f.read(_LEN.size)
    if len(head) < _LEN.size:
        return None
    (n,) = _LEN.unpack(head)
    if n > MAX_FRAME_BYTES:
        raise ValueError(f"grammar compiler frame of {n} bytes")
    data = f.read(n)
    if len(data) < n:
        return None
    return msgpack.unpackb(data, raw=False)


def choice_grammar(choices: list[str]) -> str:
    """EBNF for exactly one of `choices` (JSON string literals are xgrammar's escapes)."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


# xgrammar (0.2.x) writes a length-bounded JSON string's characters as [^"\\\r\n]: that
# admits raw control characters, which no strict JSON parser takes. Characters from U+0020
# on, less the quote and the backslash, are what JSON allows unescaped.
_LOOSE_STRING_CHAR = '[^\\"\\\\\\r\\n]'
_STRICT_STRING_CHAR = '[^\\0-\\x1f\\"\\\\]'


def strict_json_strings(ebnf: str) -> str:
    return ebnf.replace(_LOOSE_STRING_CHAR, _STRICT_STRING_CHAR)


def compile_one(compiler: Any, kind: str, text: str, any_whitespace: bool) -> Any:
    # Compact JSON by default: without any_whitespace=False *and* these separators a
    # model may emit whitespace until max_tokens (and xgrammar would make a space after
    # every comma and colon mandatory).
    ws = ({"any_whitespace": True} if any_whitespace
          else {"any_whitespace": False, "separators": (",", ":")})
    if kind in ("json", "json_object"):
        import xgrammar as xgr

        grammar = xgr.Grammar.from_json_schema(text if kind == "json" else '{"type":"object"}',
                                               **ws)
        return compiler.compile_grammar(strict_json_strings(str(grammar)))
    if kind == "regex":
        return compiler.compile_regex(text)
    if kind == "grammar":
        return compiler.compile_grammar(text)
    if kind == "choice":
        return compiler.compile_grammar(choice_grammar(json.loads(text)))
    raise ValueError(f"unknown structured output kind {kind!r}")


def _error_text(e: Exception) -> str:
    # xgrammar's messages start with "[time] /path/file.cc:line: "; keep what follows.
    msg = str(e).strip()
    if msg.startswith("[") and ".cc:" in msg.split("\n", 1)[0]:
        msg = msg.split(": ", 1)[-1] if ": " in msg else msg
    return msg.split("\n\n", 1)[0][:500] or type(e).__name__


def main() -> None:
    # Frames get a private copy of stdout; anything a library prints goes to stderr.
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    spec = json.loads(sys.argv[1])
    if spec.get("parent_pid"):
        from nvllm.common.proc import die_with_parent

        die_with_parent(spec["parent_pid"])
    import xgrammar as xgr
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(spec["tokenizer"])
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=spec["vocab_size"],
                                              stop_token_ids=spec["stop_token_ids"])
    # One thread: the workers own the cores. The leader caches compiled grammars itself.
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    inp = sys.stdin.buffer
    write_frame(out, [0, True, info.serialize_json(), 0])
    while (job := read_frame(inp)) is not None:
        job_id, kind, text, any_whitespace = job
        try:
            cg = compile_one(compiler, kind, text, any_whitespace)
            write_frame(out, [job_id, True, cg.serialize_json(), int(cg.memory_size_bytes)])
        except Exception as e:  # noqa: BLE001 (every failure is the request's 400)
            write_frame(out, [job_id, False, _error_text(e), 0])


if __name__ == "__main__":
    main()
