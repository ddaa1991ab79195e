"""Tool calls on /v1/chat/completions: `tools` and `tool_choice` in, OpenAI's `tool_calls` out.

The tools reach the model through its chat template (as `tools`, the variable Hugging Face
templates read); assistant turns that called tools and `tool` turns with their results are passed
on in the shape those templates expect (arguments as an object, not JSON text). The model's
calls are read back in the Hermes format, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
which Qwen2.5, Hermes and many fine-tunes write; a model whose template has no tool support
sees no tools (docs/http_api.md says which models work).

`tool_choice` "required" or a named function constrains the output with a grammar (one call, of
one of the tools, arguments matching its JSON Schema): the engine's structured-output masks
force it, as vLLM does. "auto" leaves it to the model; "none" renders the tools but reads no calls.
Pure: no aiohttp, no sockets.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from dualpace.errors import InvalidArgument
from dualpace.guided_spec import GuidedKind, GuidedSpec

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(CALL_OPEN) + r"\s*(.*?)\s*" + re.escape(CALL_CLOSE), re.DOTALL)
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names


@dataclass(frozen=True)
class ToolSetup:
    tools: list[dict[str, Any]]  # OpenAI's tool objects, for the chat template
    choice: str  # "none" | "auto" | "required" | "named"
    forced_name: str | None = None

    @property
    def parses_calls(self) -> bool:
        """Whether the answer is read for calls ("none": the tools are shown, calls are not read)."""
        return self.choice != "none"

    def guided(self) -> GuidedSpec | None:
        """The grammar that forces one call ("required" / named), else None."""
        if self.choice in ("none", "auto"):
            return None
        functions = [t["function"] for t in self.tools if self.forced_name in (None, t["function"]["name"])]
        shapes = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                   "properties": {"name": {"const": f["name"]},
                                  "arguments": f.get("parameters") or {"type": "object"}}} for f in functions]
        schema = shapes[0] if len(shapes) == 1 else {"anyOf": shapes}
        schema = {**schema, "x-guidance": {"whitespace_flexible": False}}  # compact: no padding to sample
        newline = json.dumps("\n")
        return GuidedSpec(GuidedKind.LARK, f"start: {json.dumps(CALL_OPEN)} {newline} call {newline} "
                                           f"{json.dumps(CALL_CLOSE)}\ncall: %json {json.dumps(schema)}")


def parse_tools(tools: Any, tool_choice: Any) -> ToolSetup | None:
    """The request's tools, or None when there are none. With tool_choice "none" the template
    still renders them (as vLLM does by default) but the answer is not read for calls."""
    if tools is None or tools == []:
        if tool_choice not in (None, "none", "auto"):
            raise InvalidArgument("tool_choice", "needs tools")
        return None
    if not isinstance(tools, list):
        raise InvalidArgument("tools", "must be a list of {\"type\": \"function\", \"function\": {...}} objects")
    names = []
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise InvalidArgument(where, 'must be {"type": "function", "function": {"name": ..., "parameters": ...}}')
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise InvalidArgument(f"{where}.function.name", "must be 1-64 letters, digits, '_' or '-'")
        if name in names:
            raise InvalidArgument(f"{where}.function.name", f"{name!r} is defined twice")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise InvalidArgument(f"{where}.function.parameters", "must be a JSON Schema object")
        names.append(name)
    if tool_choice in (None, "auto"):
        return ToolSetup(tools, "auto")
    if tool_choice == "none":
        return ToolSetup(tools, "none")
    if tool_choice == "required":
        return ToolSetup(tools, "required")
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function" \
            and isinstance(tool_choice.get("function"), dict):
        name = tool_choice["function"].get("name")
        if name not in names:
            raise InvalidArgument("tool_choice", f"names function {name!r}, which is not in tools")
        return ToolSetup(tools, "named", name)
    raise InvalidArgument("tool_choice", 'must be "none", "auto", "required" or '
                                         '{"type": "function", "function": {"name": ...}}')


def template_message(message: dict[str, Any], index: int, content: str) -> dict[str, Any]:
    """A chat message for the template: assistant tool calls with their arguments as objects,
    tool results with their tool_call_id."""
    role = message["role"]
    out: dict[str, Any] = {"role": role, "content": content}
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise InvalidArgument(f"messages[{index}].tool_call_id", "is required on a tool message: a string")
        out["tool_call_id"] = call_id
    calls = message.get("tool_calls")
    if calls:
        if role != "assistant" or not isinstance(calls, list):
            raise InvalidArgument(f"messages[{index}].tool_calls", "must be a list, on an assistant message")
        out["tool_calls"] = [_template_call(call, f"messages[{index}].tool_calls[{n}]") for n, call in enumerate(calls)]
    return out


def _template_call(call: Any, where: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise InvalidArgument(where, 'must be {"id": ..., "type": "function", "function": {"name", "arguments"}}')
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            raise InvalidArgument(f"{where}.function.arguments", "must be JSON text") from None
    return {"id": call.get("id"), "type": "function", "function": {"name": function["name"], "arguments": arguments}}


# ---------------------------------------------------------------------- output


def _openai_call(body: str) -> dict[str, Any] | None:
    try:
        call = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": call["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}}


def split_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content outside the calls, or None when there is none; the calls in OpenAI's shape).
    A <tool_call> block that is not a JSON call object stays in the content."""
    calls, kept, end = [], [], 0
    for match in _CALL.finditer(text):
        call = _openai_call(match.group(1))
        if call is None:
            continue
        kept.append(text[end:match.start()])
        end = match.end()
        calls.append(call)
    if not calls:
        return text, []
    kept.append(text[end:])
    content = "".join(kept).strip()
    return (content or None), calls


@dataclass
class ToolCallStream:
    """Streamed content with the calls held back: text before a possible `<tool_call>` goes out
    at once; from the first one on, the rest waits for the end, where the calls are parsed."""

    pending: str = ""
    in_calls: bool = False
    calls: list[dict[str, Any]] = field(default_factory=list)

    def feed(self, text: str) -> str:
        """The content that can be sent now."""
        self.pending += text
        if self.in_calls:
            return ""
        start = self.pending.find(CALL_OPEN)
        if start >= 0:
            self.in_calls = True
            out, self.pending = self.pending[:start], self.pending[start:]
            return out
        keep = next((n for n in range(min(len(CALL_OPEN) - 1, len(self.pending)), 0, -1)
                     if CALL_OPEN.startswith(self.pending[-n:])), 0)
        out, self.pending = self.pending[:len(self.pending) - keep], self.pending[len(self.pending) - keep:]
        return out

    def finish(self) -> str:
        """The content still held; self.calls then holds the parsed calls."""
        content, self.calls = split_tool_calls(self.pending)
        self.pending = ""
        return content or ""
