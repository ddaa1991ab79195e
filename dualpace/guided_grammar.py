"""A GuidedSpec as llguidance grammar text, and the check that it compiles (no tokenizer, no torch)."""

from __future__ import annotations

import json

import llguidance

from dualpace.errors import InvalidArgument
from dualpace.guided_spec import GuidedKind, GuidedSpec


def grammar_for(spec: GuidedSpec) -> str:
    """llguidance's grammar text for `spec` (not yet checked)."""
    if spec.kind == GuidedKind.JSON_SCHEMA:
        try:
            schema = json.loads(spec.spec)
        except json.JSONDecodeError as exc:
            raise ValueError(f"the schema is not valid JSON: {exc}") from None
        # Compact JSON: no free whitespace, so a sampled model cannot pad forever between tokens.
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
    if spec.kind == GuidedKind.REGEX:
        return llguidance.LLMatcher.grammar_from_regex(spec.spec)
    if spec.kind == GuidedKind.LARK:
        return llguidance.LLMatcher.grammar_from_lark(spec.spec)
    raise ValueError(f"unknown guided decoding kind {spec.kind!r}")


def check_spec(spec: GuidedSpec, field: str) -> None:
    """Raise InvalidArgument naming `field` when the grammar does not compile (no tokenizer needed)."""
    try:
        problem = llguidance.LLMatcher.validate_grammar(grammar_for(spec))
    except (ValueError, TypeError) as exc:
        problem = str(exc)
    if problem:
        raise InvalidArgument(field, f"is not a usable {spec.kind.value} constraint: {problem.strip()}")
