"""The `messages` of a /v1/chat/completions body, checked (errors name the message and field)
and put in the shape chat templates read (router/openai_tools.py for tool calls and results)."""

from __future__ import annotations

from typing import Any

from dualpace.errors import InvalidArgument
from router.openai_tools import template_message


def _message_content(content: Any, index: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidArgument(f"messages[{index}].content",
                                      "only text parts ({\"type\": \"text\", \"text\": ...}) are supported")
            texts.append(part["text"])
        return "".join(texts)
    raise InvalidArgument(f"messages[{index}].content", "must be a string or a list of text parts")


def chat_messages(messages: Any) -> list[dict[str, Any]]:
    """The checked messages of a chat body, in the shape chat templates read."""
    if messages is None:
        raise InvalidArgument("messages", "is required: a non-empty list of {role, content} objects")
    if not isinstance(messages, list) or not messages:
        raise InvalidArgument("messages", "must be a non-empty list of {role, content} objects")
    checked = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidArgument(f"messages[{index}]", "must be an object with role and content")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise InvalidArgument(f"messages[{index}].role", "must be a non-empty string")
        if role == "function":
            raise InvalidArgument(f"messages[{index}].role", "the deprecated function role is not supported: use tool")
        content = message.get("content")
        content = "" if content is None and (message.get("tool_calls") or role == "assistant") else content
        # OpenAI's "developer" role is the newer name of "system"; chat templates know "system".
        message = {**message, "role": "system" if role == "developer" else role}
        checked.append(template_message(message, index, _message_content(content, index)))
    return checked
