"""What a constrained (structured-output) request must match: plain data (no torch,
no grammar engine: dualpace/guided_grammar.py compiles it).

It rides in SamplingParams, so it travels with the request everywhere the parameters do (the
engine request, a migration, a recovery). The engine turns it into a grammar and a token mask
(dualpace/guided_decoding.py); the grammar's state is never shipped: it is rebuilt from the
request's generated tokens wherever the request is.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class GuidedKind(str, enum.Enum):
    JSON_SCHEMA = "json_schema"  # spec: a JSON Schema, as JSON text
    REGEX = "regex"  # spec: a regular expression the whole output must match
    LARK = "lark"  # spec: a Lark grammar (llguidance's dialect)


@dataclass(frozen=True)
class GuidedSpec:
    kind: GuidedKind
    spec: str
    # Outputs already generated under this constraint that are now part of the engine
    # request's prompt (a request re-submitted after its engine failed): the grammar consumes
    # the last num_output_tokens_in_prompt prompt tokens before the first sampled one.
    num_output_tokens_in_prompt: int = 0

