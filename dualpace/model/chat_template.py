"""Render a model's Jinja chat template the way Hugging Face transformers does.

Templates come from model files and are untrusted code, so they run in jinja2's
immutable sandbox. The environment matches transformers' rendering: trim_blocks
and lstrip_blocks, the loop-controls extension, a `{% generation %}` block
(rendered as its body), a `tojson` filter that keeps non-ASCII text, and the
`raise_exception` and `strftime_now` helpers.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from dualpace.errors import InvalidArgument, ModelLoadError


class _GenerationBlock(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training
    masks; for inference it renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(date_format: str) -> str:
    return datetime.now().strftime(date_format)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=16)
def compile_chat_template(template: str) -> jinja2.Template:
    """Compile a template once; a syntax error is a broken model file."""
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, "jinja2.ext.loopcontrols"]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    try:
        return environment.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as error:
        raise ModelLoadError(f"chat template has a syntax error on line {error.lineno}: {error.message}") from error


def validate_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Plain dict copies of `messages`, each with a string role and string or list content."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise InvalidArgument("messages", "must be a non-empty list of {role, content} objects")
    checked = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidArgument(f"messages[{index}]", "must be an object with role and content")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise InvalidArgument(f"messages[{index}].role", "must be a non-empty string")
        content = message.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise InvalidArgument(f"messages[{index}].content", "must be a string or a list of parts")
        checked.append(dict(message))
    return checked


def render_chat_template(
    template: str | None,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    special_tokens: Mapping[str, str] | None = None,
    **template_kwargs: Any,
) -> str:
    """The prompt text for `messages`.

    `special_tokens` supplies variables like `bos_token` and `eos_token`;
    `template_kwargs` passes extras some templates read (`tools`, `documents`,
    `enable_thinking`, ...). A template that calls `raise_exception` rejects the
    conversation: that is reported as an invalid `messages` argument.
    """
    if template is None:
        raise InvalidArgument("messages", "this model has no chat template; send a plain text prompt instead")
    compiled = compile_chat_template(template)
    variables = {**(special_tokens or {}), **template_kwargs}
    try:
        return compiled.render(
            messages=validate_messages(messages), add_generation_prompt=add_generation_prompt, **variables
        )
    except jinja2.exceptions.TemplateError as error:
        raise InvalidArgument("messages", f"rejected by the chat template: {error}") from error
