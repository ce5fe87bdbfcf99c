"""Gemma's turn format, written out: the packaged GGUF carries no chat template.

    <bos><start_of_turn>user\\n{system}\\n\\n{text}<end_of_turn>\\n
    <start_of_turn>model\\n{text}<end_of_turn>\\n ... <start_of_turn>model\\n

Gemma has no system role; like Google's own template, system text opens the first user turn.
The prompt is a list of segments so that only our markers are read as control tokens: text
from the client that happens to contain `<start_of_turn>` stays plain text.
"""

from __future__ import annotations

from typing import Any

#: (text, is_control): control segments are tokenized with special tokens on.
Segment = tuple[str, bool]

START = "<start_of_turn>"
END = "<end_of_turn>"
_ROLES = {"assistant": "model", "model": "model"}  # everything else speaks as the user
#: The roles of OpenAI's chat schema (and Gemma's own `model`); another is the client's 400.
KNOWN_ROLES = ("system", "developer", "user", "assistant", "tool", "function", "model")


class PromptError(ValueError):
    pass


def content_text(content: Any) -> str:
    """OpenAI message content: a string, or a list of parts of which the text ones count."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict):
                raise PromptError("message content parts must be objects")
            if part.get("type", "text") != "text":
                raise PromptError(
                    f"content part type {part.get('type')!r} is not supported "
                    "by the local model (text only)"
                )
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise PromptError("message content must be a string or a list of parts")


def chat_segments(messages: list[dict[str, Any]]) -> list[Segment]:
    if not messages:
        raise PromptError("messages must not be empty")
    system: list[str] = []
    turns: list[tuple[str, str]] = []
    for m in messages:
        if not isinstance(m, dict) or "role" not in m:
            raise PromptError("each message needs a role")
        role = m["role"]
        if role not in KNOWN_ROLES:
            shown = repr(role)[:64]
            raise PromptError(f"role {shown} is not one of {', '.join(KNOWN_ROLES)}")
        text = content_text(m.get("content"))
        if role in ("system", "developer"):
            system.append(text)
            continue
        turn_role = _ROLES.get(role, "user")
        if turns and turns[-1][0] == turn_role:
            turns[-1] = (turn_role, turns[-1][1] + "\n\n" + text)  # Gemma expects alternation
        else:
            turns.append((turn_role, text))
    if system:
        preamble = "\n\n".join(system)
        if turns and turns[0][0] == "user":
            turns[0] = ("user", preamble + "\n\n" + turns[0][1])
        else:
            turns.insert(0, ("user", preamble))
    segments: list[Segment] = []
    for role, text in turns:
        segments.append((f"{START}{role}\n", True))
        segments.append((text, False))
        segments.append((f"{END}\n", True))
    segments.append((f"{START}model\n", True))
    return segments
