"""Fault specs for the sim: parsed from the command line (`SPEC@RATE`), a request header
(`x-sim-fault: SPEC`) or a directive in the prompt (`[[sim fault=SPEC]]`).

SPEC is one of:
  status:CODE            answer CODE (429 carries retry-after and x-ratelimit-* headers)
  stall-first:MS         hold the first content token back for MS more milliseconds
  stall:AFTER:MS         after AFTER content tokens, pause MS milliseconds
  reset:AFTER            after AFTER content tokens, reset the connection (TCP RST)
  truncate:AFTER         after AFTER content tokens, end the body cleanly with no [DONE]
  garbage                send an event that is not JSON right after the headers
  hang-after-headers     send the headers, then nothing until the client leaves
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

KINDS = ("status", "stall-first", "stall", "reset", "truncate", "garbage", "hang-after-headers")


@dataclass(frozen=True, slots=True)
class Fault:
    kind: str
    after: int = 0  # content tokens before the fault
    ms: float = 0.0  # milliseconds of stall
    status: int = 0


#: Longest stall a fault may ask for (ms): an hour. `hang-after-headers` is the endless one.
MAX_STALL_MS = 3_600_000.0


def _ms(text: str) -> float:
    ms = float(text)
    if not 0 <= ms <= MAX_STALL_MS:  # nan and inf fail this too
        raise ValueError
    return ms


def _after(text: str) -> int:
    after = int(text)
    if after < 0:
        raise ValueError
    return after


def parse(spec: str) -> Fault:
    parts = spec.strip().split(":")
    kind, args = parts[0], parts[1:]
    try:
        if kind == "status" and len(args) == 1:
            code = int(args[0])
            if not 400 <= code <= 599:
                raise ValueError
            return Fault("status", status=code)
        if kind == "stall-first" and len(args) == 1:
            return Fault(kind, ms=_ms(args[0]))
        if kind == "stall" and len(args) == 2:
            return Fault(kind, after=_after(args[0]), ms=_ms(args[1]))
        if kind in ("reset", "truncate") and len(args) == 1:
            return Fault(kind, after=_after(args[0]))
        if kind in ("garbage", "hang-after-headers") and not args:
            return Fault(kind)
    except ValueError:
        pass
    raise ValueError(f"bad fault spec {spec!r}; see `tokenpipe sim --help`")


def parse_rated(spec: str) -> tuple[Fault, float]:
    """`SPEC@RATE`, RATE a probability per request in [0, 1]."""
    fault, sep, rate = spec.rpartition("@")
    if not sep:
        raise ValueError(f"fault {spec!r} needs a rate: SPEC@RATE, e.g. stall-first:3000@0.05")
    try:
        p = float(rate)
    except ValueError:
        p = math.nan
    if not 0 <= p <= 1:
        raise ValueError(f"fault rate must be a number within [0, 1], got {rate!r}")
    return parse(fault), p


class FaultDice:
    """Draws at most one fault per request from a seeded generator (same seed and request
    order, same faults)."""

    def __init__(self, rated: list[tuple[Fault, float]], seed: int) -> None:
        total = sum(p for _, p in rated)
        if total > 1:
            raise ValueError(f"fault rates add up to {total:g}, more than 1")
        self.rated = rated
        self._rng = random.Random(seed)

    def draw(self) -> Fault | None:
        if not self.rated:
            return None
        r = self._rng.random()
        for fault, p in self.rated:
            if r < p:
                return fault
            r -= p
        return None
