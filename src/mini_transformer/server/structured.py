"""Structured output at the HTTP door: OpenAI's `response_format` and vLLM's `guided_*` fields ->
one StructuredOutput, or a 400 naming the field.

    response_format: {"type": "text"}                                  no constraint
                     {"type": "json_object"}                           any JSON object
                     {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}
    guided_json: a schema (object or JSON text)   guided_regex: a regex   guided_choice: ["a", "b"]
    guided_grammar: EBNF (xgrammar's dialect)

At most one of them. Past the server's size limits (limits.py) it is a 400 before anything compiles it.
Whether the schema / regex / grammar compiles is the engine's check (it compiles once and caches);
`compile_structured` runs it here, on a worker thread and within the compile timeout, so a bad one is a
400 naming the field before anything is queued, and neither the event loop nor the engine thread waits
on xgrammar (the engine finds the grammar in its cache).
"""

from __future__ import annotations

from ..engine import LLMEngine
from ..engine.structured import GrammarError
from ..inference.structured import StructuredOutput
from .limits import Limits, Workers, check_constraint_size
from .protocol import ErrorResponse

FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar")


def _value(body, name: str):
    """A field of the request, declared on the model or kept among its extra fields."""
    value = getattr(body, name, None)
    return value if value is not None else (getattr(body, "model_extra", None) or {}).get(name)


def requested_structure(body, limits: Limits) -> tuple[StructuredOutput | None, str | None]:
    """The request's constraint and the field that gave it; (None, None) when there is none."""
    given = [(name, value) for name in FIELDS if (value := _value(body, name)) is not None]
    if given and given[0][0] == "response_format" and _response_format(given[0][1]) is None:
        given = given[1:]  # {"type": "text"} asks for nothing
    if len(given) > 1:
        names = " and ".join(name for name, _ in given)
        raise ErrorResponse(400, f"{names}: give one structured-output constraint, not several", param=given[1][0])
    if not given:
        return None, None
    name, value = given[0]
    check_constraint_size(limits, name, value)
    try:
        if name == "response_format":
            return _response_format(value), name
        kind = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
                "guided_grammar": "grammar"}[name]
        return StructuredOutput(**{kind: value}), name
    except (TypeError, ValueError) as err:
        raise ErrorResponse(400, f"{name}: {err}", param=name) from None


def _response_format(value) -> StructuredOutput | None:
    if not isinstance(value, dict) or value.get("type") not in ("text", "json_object", "json_schema"):
        raise ErrorResponse(400, "response_format must be {\"type\": \"text\" | \"json_object\" | \"json_schema\"}",
                            param="response_format")
    if value["type"] == "text":
        return None
    if value["type"] == "json_object":
        return StructuredOutput(json_object=True)
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise ErrorResponse(400, "response_format.json_schema must be an object with a \"schema\" object "
                                 "(OpenAI's shape: {\"name\": ..., \"schema\": {...}})", param="response_format")
    return StructuredOutput(json_schema=spec["schema"])


async def compile_structured(engine: LLMEngine, workers: Workers, body) -> StructuredOutput | None:
    """The request's constraint, compiled (and cached) by the engine now, on a worker thread: a 400 naming
    the field if it is too large, does not compile (in time), or the server's tokenizer cannot express it."""
    structured, name = await workers.run(requested_structure, body, workers.limits)
    if structured is not None:
        try:
            await workers.compile(name, _compile, engine, structured)
        except GrammarError as err:
            raise ErrorResponse(400, f"{name}: {err}", param=name) from None
    return structured


def _compile(engine: LLMEngine, structured: StructuredOutput) -> None:
    """On a worker thread: the first call also builds the engine's compiler (imports xgrammar)."""
    engine.structured_output.compile(structured)
