"""Structured-output fields of an OpenAI request as a GuidedSpec: OpenAI's `response_format`
(`text`, `json_object`, `json_schema`) and vLLM's extras `guided_json`, `guided_regex`,
`guided_choice` and `guided_grammar` (a Lark grammar, llguidance's dialect), or the same as
vLLM's newer `structured_outputs` object (`{"json" | "regex" | "choice" | "grammar": ...}`).

Pure: it checks the JSON shapes and names the field at fault (InvalidArgument, which the HTTP
front answers 400 with `param` set); whether the schema, regex or grammar compiles is checked with
the rest of the request (dualpace.validation, field "guided", renamed to the field used here).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from dualpace.errors import InvalidArgument
from dualpace.guided_spec import GuidedKind, GuidedSpec
from dualpace.sampling_params import SamplingParams

GUIDED_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                 "structured_outputs")
# vLLM's newer `structured_outputs` object: its keys and the guided_* field each stands for.
_STRUCTURED_OUTPUT_KEYS = {"json": "guided_json", "regex": "guided_regex", "choice": "guided_choice",
                           "grammar": "guided_grammar"}
ANY_JSON_OBJECT = '{"type": "object"}'


def _response_format(value: Any) -> GuidedSpec | None:
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise InvalidArgument("response_format", 'must be an object with a "type": text, json_object or json_schema')
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return GuidedSpec(GuidedKind.JSON_SCHEMA, ANY_JSON_OBJECT)
    if kind != "json_schema":
        raise InvalidArgument("response_format", f"type {kind!r} is not one of text, json_object, json_schema")
    wrapper = value.get("json_schema")
    if not isinstance(wrapper, dict):
        raise InvalidArgument("response_format", 'json_schema needs "json_schema": {"name": ..., "schema": {...}}')
    schema = wrapper.get("schema")
    if schema is None:  # OpenAI lets it out; then any JSON object
        return GuidedSpec(GuidedKind.JSON_SCHEMA, ANY_JSON_OBJECT)
    if not isinstance(schema, dict):
        raise InvalidArgument("response_format", f"json_schema.schema must be a JSON Schema object, got {schema!r}")
    return GuidedSpec(GuidedKind.JSON_SCHEMA, json.dumps(schema))


def _structured_outputs(value: Any) -> GuidedSpec | None:
    """vLLM's {"json" | "regex" | "choice" | "grammar": ...}; exactly one key."""
    if not isinstance(value, dict) or len(value) != 1 or next(iter(value)) not in _STRUCTURED_OUTPUT_KEYS:
        # (vLLM's other keys, such as json_object or structural_tag, are not taken)
        raise InvalidArgument("structured_outputs", "must be an object with one of the keys json, regex, choice, "
                                                    "grammar")
    key, inner = next(iter(value.items()))
    try:
        return _one(_STRUCTURED_OUTPUT_KEYS[key], inner)
    except InvalidArgument as exc:
        raise InvalidArgument(f"structured_outputs.{key}", exc.problem) from None


def _guided_json(value: Any) -> GuidedSpec:
    if isinstance(value, str):
        return GuidedSpec(GuidedKind.JSON_SCHEMA, value)  # JSON text; checked when compiled
    if isinstance(value, dict):
        return GuidedSpec(GuidedKind.JSON_SCHEMA, json.dumps(value))
    raise InvalidArgument("guided_json", "must be a JSON Schema (an object, or its JSON text)")


def _text(name: str, value: Any, kind: GuidedKind) -> GuidedSpec:
    if not isinstance(value, str) or not value:
        raise InvalidArgument(name, "must be a non-empty string")
    return GuidedSpec(kind, value)


def _guided_choice(value: Any) -> GuidedSpec:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
        raise InvalidArgument("guided_choice", "must be a non-empty list of non-empty strings")
    # A Lark grammar of string literals; JSON's string escapes are Lark's.
    return GuidedSpec(GuidedKind.LARK, "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in value))


def _one(name: str, value: Any) -> GuidedSpec | None:
    if name == "response_format":
        return _response_format(value)
    if name == "guided_json":
        return _guided_json(value)
    if name == "guided_regex":
        return _text(name, value, GuidedKind.REGEX)
    if name == "guided_grammar":
        return _text(name, value, GuidedKind.LARK)
    return _guided_choice(value)


def guided_from_body(fields: dict[str, Any]) -> tuple[GuidedSpec | None, str | None]:
    """(the constraint, the name of the field it came from) from the GUIDED_FIELDS of a body
    (absent ones None); at most one may constrain the output."""
    found: list[tuple[GuidedSpec, str]] = []
    for name in GUIDED_FIELDS:
        value = fields.get(name)
        if value is None:
            continue
        spec = _structured_outputs(value) if name == "structured_outputs" else _one(name, value)
        if spec is not None:
            found.append((spec, name))
    if len(found) > 1:
        raise InvalidArgument(found[1][1], f"cannot be combined with {found[0][1]}: send one output constraint")
    return found[0] if found else (None, None)


def with_guided(read: Callable[[str], Any], params: SamplingParams, renamed: dict[str, str],
                forced: GuidedSpec | None = None) -> SamplingParams:
    """params with the request's output constraint: its structured-output field (read(name) gives a
    body field), or `forced` (a required tool call); renamed learns the field a bad spec is named by."""
    guided, field = guided_from_body({name: read(name) for name in GUIDED_FIELDS})
    if forced is not None:
        if guided is not None:
            raise InvalidArgument("tool_choice", f"a required or named tool call cannot be combined with {field}")
        guided, field = forced, "tool_choice"
    if guided is None:
        return params
    renamed["guided"] = field
    return replace(params, guided=guided)
