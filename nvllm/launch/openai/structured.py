"""The one output constraint a request may set, whichever way it spells it: OpenAI's
``response_format``, vLLM's ``structured_outputs`` or its older ``guided_*`` fields, or a
forced tool choice (tools.py). It becomes the ``structured_outputs`` map of the leader's
SamplingParams (nvllm/common/structured_outputs.py), which the leader compiles: a schema,
regex or grammar it cannot compile comes back as an ``invalid_request`` error, a 400.

The body models (schemas.py) already bound each spelling's sizes and turned schemas into
compact JSON text; here only what spans fields is checked."""

from __future__ import annotations

from typing import Any

from nvllm.common.structured_outputs import KINDS
from nvllm.launch.openai.errors import ApiError
from nvllm.launch.openai.schemas import SamplingBody

# vLLM's older fields and the structured_outputs kind each one is.
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}


def _structured(body: SamplingBody) -> dict[str, Any]:
    so = body.structured_outputs
    set_ = {k: getattr(so, "json_" if k == "json" else k) for k in KINDS}
    set_ = {k: v for k, v in set_.items() if v is not None and v is not False}
    if len(set_) != 1:
        raise ApiError(400, f"structured_outputs must set exactly one of {', '.join(KINDS)} "
                            f"(got {', '.join(set_) or 'none'})", param="structured_outputs",
                       code="invalid_value")
    return set_


def constraint(body: SamplingBody, forced: tuple[str, dict] | None = None
               ) -> tuple[str, dict[str, Any]] | None:
    """(the request field that set it, the leader's structured_outputs map) for `body`, or
    None. `forced` is such a pair from elsewhere, e.g. a tool_choice. More than one source
    is a 400 naming them (they could not all hold), and so is ignore_eos with any (a
    constrained output ends with EOS once it is complete; SamplingParams refuses it too)."""
    found: list[tuple[str, dict[str, Any]]] = []
    rf = body.response_format
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", {"json_object": True}))
    elif rf is not None and rf.type == "json_schema":
        found.append(("response_format", {"json": rf.json_schema.schema_}))
    if body.structured_outputs is not None:
        found.append(("structured_outputs", _structured(body)))
    for name, kind in GUIDED.items():
        if getattr(body, name) is not None:
            found.append((name, {kind: getattr(body, name)}))
    if forced is not None:
        found.append(forced)
    if len(found) > 1:
        raise ApiError(400, f"{' and '.join(n for n, _ in found)} each constrain the output: "
                            "a request may set one", param=found[1][0], code="invalid_value")
    if not found:
        return None
    if body.ignore_eos:
        raise ApiError(400, f"ignore_eos cannot be combined with {found[0][0]}: a constrained "
                            "output ends with EOS once it is complete", param="ignore_eos",
                       code="invalid_value")
    return found[0]


def blame(e: ApiError, source: str) -> ApiError:
    """A leader's 400 about the constraint (it did not compile: ``invalid
    structured_outputs.regex: ...``) names the request field the constraint came from."""
    if e.status == 400 and "structured_outputs" in e.message:
        e.param = source
    return e
