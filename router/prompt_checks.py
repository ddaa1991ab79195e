"""Checks on a prompt's text before it reaches the tokenizer or the chat template, each naming
the field: text that is not a sequence of Unicode characters (a lone UTF-16 surrogate such as
"\\ud800", which JSON allows and the tokenizer rejects with a TypeError), and chat roles outside
what the API and the proto allow."""

from __future__ import annotations

from dualpace.errors import InvalidArgument

CHAT_ROLES = ("system", "user", "assistant", "tool")


def check_text(text: str, field: str) -> None:
    """InvalidArgument naming `field` when `text` holds a lone surrogate (U+D800..U+DFFF)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidArgument(field, f"holds a lone UTF-16 surrogate ({text[exc.start]!r} at character "
                                     f"{exc.start}), which is not a Unicode character") from None


def check_messages(messages: list[dict[str, str]]) -> None:
    """Every message's role is one of CHAT_ROLES and its content is text."""
    for index, message in enumerate(messages):
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise InvalidArgument(f"messages[{index}].role", f"is {role!r}; must be one of {', '.join(CHAT_ROLES)}")
        check_text(message.get("content", ""), f"messages[{index}].content")
