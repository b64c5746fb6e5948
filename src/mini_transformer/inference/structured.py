"""StructuredOutput: what shape a request's output must take (a JSON schema, any JSON object, a regex, one
of a list of strings, or an EBNF grammar). A small frozen value: it rides inside SamplingParams, which
stays hashable, and it is the key under which the engine caches the compiled grammar.

    StructuredOutput(json_schema={"type": "object", "properties": {"n": {"type": "integer"}}})
    StructuredOutput(json_object=True)        # any JSON object
    StructuredOutput(regex=r"\\d{3}-\\d{4}")
    StructuredOutput(choice=("yes", "no"))
    StructuredOutput(grammar='root ::= "a" root | "b"')   # EBNF in xgrammar's dialect (GBNF-like)

Only the shape of the value is checked here (one kind, the right types, a schema that is a JSON object).
Whether the schema, regex or grammar compiles is decided where it is compiled (engine/structured.py), and
that door names the field at fault. This module never imports xgrammar.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutput:
    json_schema: str | dict | None = None  # kept as compact JSON text (key order kept: it orders the output)
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"StructuredOutput needs exactly one of {', '.join(KINDS)}; got {given or 'none'}")
        if not isinstance(self.json_object, bool):
            raise TypeError(f"json_object={self.json_object!r} must be a bool")
        if self.json_schema is not None:
            object.__setattr__(self, "json_schema", _canonical_schema(self.json_schema))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise TypeError(f"{name}={value!r} must be a non-empty string")
        if self.choice is not None:
            choices = self.choice
            if (not isinstance(choices, list | tuple) or not choices
                    or not all(isinstance(c, str) and c for c in choices)):
                raise TypeError(f"choice={choices!r} must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", tuple(choices))

    @property
    def kind(self) -> str:
        return next(kind for kind in KINDS if getattr(self, kind) not in (None, False))


def _canonical_schema(schema) -> str:
    """A schema (dict or JSON text) -> compact JSON text; it must be a JSON object. Keys keep their order:
    the grammar writes an object's properties in the order the schema declares them."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as err:
            raise ValueError(f"json_schema is not valid JSON ({err})") from None
    if not isinstance(schema, dict):
        raise TypeError(f"json_schema must be a JSON object (a dict), got {type(schema).__name__}")
    try:
        return json.dumps(schema, separators=(",", ":"))
    except (TypeError, ValueError) as err:
        raise ValueError(f"json_schema cannot be written as JSON ({err})") from None
