"""What the local model cannot honour is a 400 naming the parameter, never a 200 that ignores it.

The engine samples plain text from one sequence: it has no tool-call grammar, no constrained
decoding and does not return token log-probabilities. Parameters that only *allow* a behaviour
(`tools` with `tool_choice` "auto" or "none", `logprobs: false`, `response_format` "text") are
accepted: answering with plain text honours them.
"""

from __future__ import annotations

from typing import Any

from tokenpipe.errors import GatewayError


def check(
    *,
    tools: Any,
    tool_choice: Any,
    logprobs: Any,
    top_logprobs: Any,
    response_format: Any,
) -> None:
    """Raises a 400 for the first parameter the local model cannot honour."""
    forced = tool_choice == "required" or isinstance(tool_choice, dict)
    if forced and tools:
        raise _refuse(
            "tool_choice",
            "tool_choice forces a tool call; the local model cannot call tools "
            '(use "auto" or "none", or an upstream with tool support)',
        )
    # Chat: logprobs true/false; completions: logprobs an int (0 returns none either way).
    if logprobs not in (None, False, 0):
        raise _refuse("logprobs", "logprobs are not available from the local model")
    if top_logprobs not in (None, 0):
        raise _refuse("top_logprobs", "top_logprobs are not available from the local model")
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if response_format is not None and kind != "text":
        raise _refuse(
            "response_format",
            f"response_format {kind or response_format!r} needs constrained decoding, "
            'which the local model does not do (only "text")',
        )


def _refuse(param: str, message: str) -> GatewayError:
    return GatewayError(400, message, param=param, code="unsupported_parameter")
