"""What the limiter takes from the levels an upstream states (`x-ratelimit-remaining-*`):
which of its own reservations a level counts from, and when the next answer's headers are
read. Pure functions of the limiter's state, with the clock's reading passed in."""

from __future__ import annotations

from typing import Protocol, TypeVar

from tokenpipe.control.store import Decision, Limits


class Sent(Protocol):
    """A request the limiter let out (its `Permit`)."""

    decision: Decision  # its reservation
    tokens: float  # reserved
    granted_at: float  # clock seconds


P = TypeVar("P", bound=Sent)

#: Longest a request sent may not have reached the upstream yet (seconds): an answer is
#: counted from the oldest request still unanswered that was sent within it (`counted_from`).
UNCOUNTED_S = 1.0
#: A 200's rate-limit headers are read at most once every LEARN_EVERY_S (seconds) while each
#: level last stated is above LEARN_ALL_BELOW of its bucket; below it, for a 429 and until a
#: level is stated, every answer's are. Reading OpenAI's six cost 58,000 machine instructions
#: an answer, 7% of a request (request_instructions.py --ratelimit-headers). Meanwhile the
#: local buckets hold the levels, charged for every request sent (by every replica, with
#: Redis): unseen for LEARN_EVERY_S is only other clients' use of the key, which would have
#: to take 3/4 of a bucket in that time to empty it unseen (its 429 is read at once). A
#: gateway with fewer answers than one a LEARN_EVERY_S reads every one.
LEARN_EVERY_S = 0.05
LEARN_ALL_BELOW = 0.25


def next_reading(
    limits: Limits, remaining_requests: float | None, remaining_tokens: float | None, now: float
) -> float | None:
    """When the next 200's headers are read, from the levels an answer stated just now:
    None (the next answer's) when none was stated or one is low."""
    if remaining_requests is None and remaining_tokens is None:
        return None
    for rem, spec in ((remaining_requests, limits.requests), (remaining_tokens, limits.tokens)):
        if rem is not None and spec is not None and rem < LEARN_ALL_BELOW * spec.capacity:
            return None
    return now + LEARN_EVERY_S


def counted_from(pending: dict[P, None], permit: P, now: float) -> Decision:
    """The reservation `permit`'s answer counts from. An upstream's `remaining` counts the
    requests it had received when it answered; the store subtracts those reserved after this
    one, which is exact only if the upstream received them in that order. Requests sent
    together over many connections arrive in any order: the oldest one still unanswered
    (`pending`, oldest first) may not have been counted, nor any after it. So the count
    starts just before it: the level learned is at most what is really left (a few requests
    under it while they are on their way), never above it, which cost 429s. Drops from
    `pending` the permits sent more than UNCOUNTED_S ago (the upstream has them)."""
    cutoff = now - UNCOUNTED_S
    while pending:
        oldest = next(iter(pending))
        if oldest.granted_at >= cutoff:
            break
        del pending[oldest]  # long on its way: the upstream has it
    else:
        return permit.decision
    d, mine = oldest.decision, permit.decision
    if d.origin != mine.origin or d.seq_requests >= mine.seq_requests:
        return mine
    before = d.seq_tokens - oldest.tokens
    # (Decision(...), not d._replace: that goes through _make and a map over the fields.)
    return Decision(
        d.wait, d.seq_requests - 1.0, before, d.remaining_requests, d.remaining_tokens, d.origin
    )
