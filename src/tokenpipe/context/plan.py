"""Deciding what to do with a request and its window: pure arithmetic on token counts.

The rules, in order (docs/context.md has the worked version):

1. The request fits (prompt + wanted output + margin <= window): nothing changes.
2. The prompt leaves room for at least `min(wanted, min_output)` tokens: `max_tokens` is lowered
   to the room there is.
3. Else the history is compressed: system/developer messages and the newest turns are kept,
   as many turns as fit a budget that leaves `min(wanted, reserve_output)` tokens for output;
   the older turns are dropped (truncate) or replaced by a summary (summarize).
4. If even the system messages and the last turn leave no `min_output` tokens: a 400
   `context_length_exceeded` from the gateway, since the upstream could only fail.

A turn starts at a user message and runs to the next one, so an assistant message is never
separated from the tool results that answer its calls, and the kept history still alternates
user/assistant as strict chat templates (Gemma's) require.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

KEPT_ROLES = ("system", "developer")

Action = Literal["fits", "lower", "compress", "reject"]


@dataclass(frozen=True, slots=True)
class Limits:
    window: int  # tokens, prompt + output
    margin: int  # tokens kept free
    reserve_output: int  # output room assumed without max_tokens
    min_output: int  # below this much room, compress instead of lowering max_tokens
    #: Share of the prompt budget a compression fills (1.0: drop only what does not fit;
    #: less leaves room for the next turns, so they reuse the same compressed prefix).
    compress_target: float = 1.0


@dataclass(frozen=True, slots=True)
class Decision:
    action: Action
    #: Messages [first_kept_turn_start:] (plus all system messages) are kept when compressing.
    keep_from: int = 0
    #: The max_tokens to send (None: leave the client's value or absence as it is).
    max_tokens: int | None = None
    #: Prompt tokens after the decision (excluding any summary still to be written).
    prompt_tokens: int = 0


def turn_starts(messages: Sequence[dict[str, Any]]) -> list[int]:
    """Indices where a turn begins: every user message, and the first non-system message."""
    starts: list[int] = []
    for i, m in enumerate(messages):
        role = m.get("role")
        if role in KEPT_ROLES:
            continue
        if role == "user" or not starts:
            starts.append(i)
    return starts


def decide(
    messages: Sequence[dict[str, Any]],
    costs: Sequence[int],
    reply: int,
    max_tokens: int | None,
    limits: Limits,
    extra: int = 0,
) -> Decision:
    """What to do with a chat request. costs[i]: tokens of messages[i]; reply: priming tokens.

    extra: tokens a compression adds back (room reserved for a summary message).
    """
    prompt = sum(costs) + reply
    room = limits.window - limits.margin - prompt
    want = max_tokens if max_tokens is not None else limits.reserve_output
    if room >= want:
        return Decision("fits", prompt_tokens=prompt)
    if room >= min(want, limits.min_output):
        return Decision("lower", max_tokens=room, prompt_tokens=prompt)

    starts = turn_starts(messages)
    if len(starts) < 2:  # a single turn: nothing older to drop
        return Decision("reject", prompt_tokens=prompt)
    kept_system = sum(
        c for m, c in zip(messages, costs, strict=True) if m.get("role") in KEPT_ROLES
    )
    target_out = min(want, limits.reserve_output)
    prompt_budget = limits.window - limits.margin - target_out
    budget = int(prompt_budget * limits.compress_target) - reply - kept_system - extra
    # Newest turns first; the last turn is always kept.
    tail = 0
    keep = len(starts) - 1
    for t in range(len(starts) - 1, -1, -1):
        end = starts[t + 1] if t + 1 < len(starts) else len(messages)
        cost = sum(
            c
            for m, c in zip(messages[starts[t] : end], costs[starts[t] : end], strict=True)
            if m.get("role") not in KEPT_ROLES
        )
        if t < len(starts) - 1 and tail + cost > budget:
            break
        tail += cost
        keep = t
    keep_from = starts[keep]
    if keep == 0:
        keep_from = starts[1]  # everything fit the budget but not the window: drop one turn
        tail = sum(
            c
            for m, c in zip(messages[keep_from:], costs[keep_from:], strict=True)
            if m.get("role") not in KEPT_ROLES
        )
    new_prompt = kept_system + tail + reply + extra
    room = limits.window - limits.margin - new_prompt
    if room < min(want, limits.min_output):
        return Decision("reject", prompt_tokens=new_prompt)
    return Decision(
        "compress",
        keep_from=keep_from,
        max_tokens=room if room < want else None,
        prompt_tokens=new_prompt,
    )


def split(
    messages: Sequence[dict[str, Any]], keep_from: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """(system messages, the older messages to drop or summarise, the kept messages)."""
    system = [m for m in messages if m.get("role") in KEPT_ROLES]
    older = [m for m in messages[:keep_from] if m.get("role") not in KEPT_ROLES]
    kept = [m for m in messages[keep_from:] if m.get("role") not in KEPT_ROLES]
    return system, older, kept


def decide_text(prompt: int, max_tokens: int | None, limits: Limits) -> Decision:
    """A text completion: nothing to compress, only max_tokens to lower (or a 400)."""
    room = limits.window - limits.margin - prompt
    want = max_tokens if max_tokens is not None else limits.reserve_output
    if room >= want:
        return Decision("fits", prompt_tokens=prompt)
    if room >= min(want, limits.min_output):
        return Decision("lower", max_tokens=room, prompt_tokens=prompt)
    return Decision("reject", prompt_tokens=prompt)
