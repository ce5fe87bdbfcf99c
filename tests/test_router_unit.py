"""The router on its own, in-process (no sockets, no processes): the race for the first token,
the one retry loop, mid-stream recovery (its record's bound alone: test_relay_record.py).

Upstreams are `ScriptedUpstream`s answering with real `UpstreamResponse`s fed by hand; the
limiters and tickets are real (`TrafficControl` from settings). The retry loop's policy runs
on a ManualClock. The race's deadlines are real loop time, kept to tens of milliseconds, and
every test waits on the router's own result (an outer timeout only guards against a hang)."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

from tests.scripted_upstream import (
    MODEL,
    ROLE,
    Answer,
    ScriptedUpstream,
    completion,
    content,
    error_body,
    settings_for,
    stream,
)
from tokenpipe.clock import MONOTONIC, Clock, ManualClock
from tokenpipe.control.deadline import UNBOUNDED
from tokenpipe.control.traffic import TrafficControl
from tokenpipe.dialects import CHAT, Piece
from tokenpipe.errors import GatewayError
from tokenpipe.observe import metrics
from tokenpipe.relay.buffer import Accumulator
from tokenpipe.relay.events import RECORD_MAX_BYTES, EventParser
from tokenpipe.relay.stream import relay_stream
from tokenpipe.relay.tally import StreamTally
from tokenpipe.router import Router
from tokenpipe.router import attempt as attempt_mod
from tokenpipe.router.attempt import Attempt, Request, Tries, until_answered
from tokenpipe.router.policy import Policy
from tokenpipe.router.race import first_content
from tokenpipe.router.route import Route, open_route
from tokenpipe.router.stream import reader
from tokenpipe.upstream.errors import UpstreamDisconnected

#: Guards every wait on the router: a hang fails the test instead of stalling the suite.
HANG = 5.0
#: The race's deadlines (seconds of loop time): short, and never what a test waits on.
TTFT = 0.05
NO_HEDGE: dict[str, Any] = {"hedging": {"enabled": False}}


def _sample(name: str, **labels: str) -> float:
    return metrics.REGISTRY.get_sample_value(name, labels) or 0.0


def _retries(reason: str, outcome: str) -> float:
    return _sample("tokenpipe_retries_total", reason=reason, outcome=outcome)


def _hedges(outcome: str) -> float:
    return _sample("tokenpipe_hedges_total", outcome=outcome)


class Rig:
    """One request through the router to scripted upstreams: settings, policy, limiters, the
    request and its ticket and stream parser."""

    def __init__(
        self,
        upstreams: list[ScriptedUpstream],
        tail: dict[str, Any] | None = None,
        *,
        clock: Clock = MONOTONIC,
        stream: bool = True,
    ) -> None:
        self.settings = settings_for(upstreams, tail)
        self.policy = Policy(self.settings.tail, Router(list(upstreams)), clock)
        self.traffic = TrafficControl(self.settings)
        self.obj: dict[str, Any] = {
            "model": MODEL,
            "stream": stream,
            "messages": [{"role": "user", "content": "hi"}],
        }
        body = orjson.dumps(self.obj)
        self.req = Request(MODEL, CHAT, self.obj, body, "req-1", UNBOUNDED, stream=stream)
        self.ticket = self.traffic.internal(self.obj)
        self.parser = EventParser(StreamTally("-", MODEL, 0.0), False, CHAT)

    def inflight(self) -> int:
        return sum(limiter.inflight for limiter in self.traffic.limiters.values())

    async def route(self) -> Route:
        async with asyncio.timeout(HANG):
            return await open_route(self.policy, self.req, self.ticket)

    async def loop(self, tries: Tries | None = None) -> Attempt | None:
        async with asyncio.timeout(HANG):
            return await until_answered(
                self.policy,
                self.req,
                tries or Tries(self.policy.send_limit()),
                body=self.req.body,
                first_token=False,
                ticket=lambda: self.ticket,
            )

    async def relay(self, route: Route) -> tuple[GatewayError | None, list[Piece]]:
        """The client's side of the stream: every piece the writer sends, and the error."""
        got: list[Piece] = []

        async def emit(pieces: list[Piece]) -> None:
            got.extend(pieces)

        async with asyncio.timeout(HANG):
            error = await relay_stream(reader(route, self.parser), emit)
        return error, got

    async def close(self, route: Route | None = None, a: Attempt | None = None) -> None:
        """Ends the request as `Call.close` would; nothing may stay held."""
        if route is not None:
            route.close()
        if a is not None and a.resp is not None:
            a.resp.close()
        self.ticket.finish()
        self.parser.close()
        assert self.inflight() == 0, "a limiter permit leaked"
        await self.traffic.close()


def _text(pieces: list[Piece]) -> str:
    return "".join(p.text for p in pieces)


def _roles(pieces: list[Piece]) -> int:
    return sum(1 for p in pieces if b'"role"' in p.event())


# -- the race for the first token (race.first_content) -----------------------------------------


async def test_a_hedge_with_content_first_wins_and_the_first_response_is_closed() -> None:
    a = ScriptedUpstream("a", [Answer(chunks=[ROLE], end=False)])  # headers, role, then nothing
    b = ScriptedUpstream("b", [Answer(chunks=stream(" hedged", " answer"))])
    rig = Rig([a, b], {"hedging": {"initial_delay_seconds": 0.01}})
    won = _hedges("won")
    route = await rig.route()
    acc = Accumulator()
    async with asyncio.timeout(HANG):
        resp = await first_content(route, rig.parser, acc)
    assert resp is b.sent[0].resp and route.upstream is b and route.uresp is resp
    loser = a.sent[0]
    assert loser.closed and loser.conn.aborted  # the upstream sees the request dropped
    assert _hedges("won") == won + 1
    pieces = list(acc.pending)
    assert _text(pieces) == " hedged answer"
    assert _roles(pieces) == 1  # the first response's role chunk; the hedge's is dropped
    await rig.close(route)


def _ttft_rig(a: ScriptedUpstream, b: ScriptedUpstream) -> Rig:
    """`a`'s TTFT deadline is TTFT (no estimate yet: the initial value); `b`'s is 1 s (one
    sample, clamped to the floor), so the retry that answers at once is never cut short by a
    busy machine."""
    ttft = {"initial_seconds": TTFT, "floor_seconds": 1.0}
    rig = Rig([a, b], {**NO_HEDGE, "ttft": ttft, "min_samples": 1})
    rig.policy.ttft_estimate(b.name, MODEL, rig.req.cls).add(0.001)
    assert rig.policy.ttft_deadline(a.name, MODEL, rig.req.cls) == TTFT
    assert rig.policy.ttft_deadline(b.name, MODEL, rig.req.cls) == 1.0
    return rig


async def test_past_the_ttft_deadline_a_retry_on_the_next_upstream_wins() -> None:
    a = ScriptedUpstream("a", [Answer(chunks=[ROLE], end=False)])
    b = ScriptedUpstream("b", [Answer(chunks=stream(" retried"))])
    rig = _ttft_rig(a, b)
    retried = _retries("ttft_deadline", "retried")
    route = await rig.route()
    acc = Accumulator()
    async with asyncio.timeout(HANG):
        resp = await first_content(route, rig.parser, acc)
    assert resp is b.sent[0].resp and route.upstream is b
    assert b.sent[0].body == rig.req.body  # the request again, unchanged
    assert a.sent[0].closed and a.sent[0].conn.aborted
    assert _retries("ttft_deadline", "retried") == retried + 1
    assert _text(list(acc.pending)) == " retried"
    await rig.close(route)


async def test_when_the_retry_after_the_ttft_deadline_also_stalls_its_error_is_raised() -> None:
    a = ScriptedUpstream("a", [Answer(chunks=[ROLE], end=False)])
    b = ScriptedUpstream("b", [Answer(chunks=[ROLE], end=False)])
    tail = {**NO_HEDGE, "ttft": {"initial_seconds": TTFT}, "retries": {"max_attempts": 2}}
    rig = Rig([a, b], tail)
    route = await rig.route()
    with pytest.raises(GatewayError) as e:
        async with asyncio.timeout(HANG):
            await first_content(route, rig.parser, Accumulator())
    assert e.value.status == 504 and e.value.code == "upstream_timeout"
    assert e.value.message == f"Upstream 'b' sent no first token within {TTFT:.3g} s."
    assert b.sent[0].closed and b.sent[0].conn.aborted  # the failed retry, at once
    assert len(a.sent) == 1  # max_attempts: the first send and one retry
    await rig.close(route)
    assert a.sent[0].closed and a.sent[0].conn.aborted  # with the request, at the latest


async def test_past_the_ttft_deadline_the_first_response_is_closed_before_the_retry() -> None:
    open_at_retry: list[bool] = []
    a = ScriptedUpstream("a", [Answer(chunks=[ROLE], end=False)])

    def check(_: ScriptedUpstream) -> None:
        open_at_retry.append(not a.sent[0].conn.aborted)

    b = ScriptedUpstream("b", [Answer(chunks=stream(" retried"))], on_post=check)
    rig = _ttft_rig(a, b)
    route = await rig.route()
    try:
        async with asyncio.timeout(HANG):
            await first_content(route, rig.parser, Accumulator())
        assert open_at_retry == [False], "the stalled response was still open upstream"
    finally:
        await rig.close(route)


async def test_a_failed_hedge_and_no_first_token_by_the_deadline_end_with_the_ttft_error() -> None:
    a = ScriptedUpstream("a", [Answer(chunks=[ROLE], end=False)])
    b = ScriptedUpstream("b", [Answer(500, [error_body(500)])])
    tail = {
        "hedging": {"initial_delay_seconds": 0.01},
        "ttft": {"initial_seconds": 0.3},  # room for the hedge's 500 on a busy machine
        "retries": {"enabled": False},
    }
    rig = Rig([a, b], tail)
    failed = _hedges("failed")
    route = await rig.route()
    with pytest.raises(GatewayError) as e:
        async with asyncio.timeout(HANG):
            await first_content(route, rig.parser, Accumulator())
    assert e.value.status == 504 and e.value.code == "upstream_timeout"
    assert "within the TTFT deadline of 0.3 s" in e.value.message
    assert _hedges("failed") == failed + 1
    assert b.sent[0].closed  # the hedge's 500, at once
    await rig.close(route)
    assert a.sent[0].closed and a.sent[0].conn.aborted


# -- the one retry loop (attempt.until_answered) ----------------------------------------------


async def test_a_5xx_falls_over_to_the_next_upstream() -> None:
    a = ScriptedUpstream("a", [Answer(500, [error_body(500)])])
    b = ScriptedUpstream("b", [Answer(200, [completion("ok")])])
    rig = Rig([a, b], clock=ManualClock(), stream=False)
    retried = _retries("status_5xx", "retried")
    got = await rig.loop()
    assert got is not None and got.ok and got.upstream is b
    assert got.resp is b.sent[0].resp and got.resp.status == 200
    assert a.sent[0].closed  # the failed answer was discarded before the retry
    assert [s.body for s in a.sent + b.sent] == [rig.req.body] * 2
    assert _retries("status_5xx", "retried") == retried + 1
    await rig.close(a=got)


@pytest.mark.parametrize("max_attempts", [1, 2, 3, 4])
async def test_no_more_sends_than_max_attempts(max_attempts: int) -> None:
    order: list[str] = []

    def log(u: ScriptedUpstream) -> None:
        order.append(u.name)

    fail = [Answer(500, [error_body(500)]) for _ in range(2)]
    ups = [ScriptedUpstream(n, list(fail), on_post=log) for n in "abc"]
    rig = Rig(ups, {"retries": {"max_attempts": max_attempts}}, clock=ManualClock(), stream=False)
    got = await rig.loop()
    # In config order, every upstream before one that failed is tried again.
    assert order == ["a", "b", "c", "a"][:max_attempts]
    last = {u.name: u for u in ups}[order[-1]].sent[-1]
    # The last failure goes back to the caller as it was (open, to pass on or discard).
    assert got is not None and not got.ok and got.resp is last.resp and not last.closed
    assert all(s.closed for u in ups for s in u.sent if s is not last)
    await rig.close(a=got)


async def test_an_exhausted_retry_budget_stops_the_loop_and_counts_no_budget() -> None:
    ups = [ScriptedUpstream(n, [Answer(500, [error_body(500)])]) for n in "abc"]
    tail = {"retries": {"max_attempts": 5, "budget_ratio": 0, "budget_reserve": 1}}
    rig = Rig(ups, tail, clock=ManualClock(), stream=False)
    retried, refused = _retries("status_5xx", "retried"), _retries("status_5xx", "no_budget")
    got = await rig.loop()
    assert [len(u.sent) for u in ups] == [1, 1, 0]  # one retry in the budget, then none
    assert got is not None and got.upstream is ups[1] and got.resp is not None
    assert got.resp.status == 500
    assert _retries("status_5xx", "retried") == retried + 1
    assert _retries("status_5xx", "no_budget") == refused + 1
    await rig.close(a=got)


@pytest.mark.parametrize(
    ("names", "pause", "sends"),
    [
        ("a", {"retry-after": "30"}, [1]),  # the only upstream asks for 30 s: the client decides
        ("a", {"retry-after-ms": "1"}, [2]),  # a short pause: retried on the same upstream
        ("ab", {"retry-after": "30"}, [1, 1]),  # another upstream: falls over whatever it asks
    ],
)
async def test_a_429_is_retried_unless_the_only_upstream_asks_for_a_long_pause(
    names: str, pause: dict[str, str], sends: list[int]
) -> None:
    limited = Answer(429, [error_body(429)], headers=pause)
    ok = Answer(200, [completion("ok")])
    ups = [ScriptedUpstream("a", [limited, ok])]
    if len(names) > 1:
        ups.append(ScriptedUpstream("b", [ok]))
    tail = {"retries": {"backoff_base_seconds": 0.001}}
    rig = Rig(ups, tail, clock=ManualClock(), stream=False)
    retried = _retries("status_429", "retried")
    got = await rig.loop()
    assert [len(u.sent) for u in ups] == sends
    assert got is not None and got.resp is not None
    if sum(sends) == 1:
        assert got.resp.status == 429 and not got.ok  # with its Retry-After, for the client
        assert got.resp.headers["retry-after"] == "30"
        assert _retries("status_429", "retried") == retried
    else:
        assert got.ok and got.resp.status == 200
        assert _retries("status_429", "retried") == retried + 1
    await rig.close(a=got)


# -- mid-stream recovery (resume) ----------------------------------------------------------

CUT = UpstreamDisconnected("the upstream connection broke mid-response")
RESUME: dict[str, Any] = {**NO_HEDGE, "retries": {"backoff_base_seconds": 0.001}}


def _cut_then_continued(
    texts: list[str], rest: list[str]
) -> tuple[ScriptedUpstream, ScriptedUpstream]:
    """`a` streams `texts` and breaks; `b` (the only upstream that continues a final assistant
    message) answers the continuation with `rest`."""
    a = ScriptedUpstream("a", [Answer(chunks=[ROLE, *map(content, texts)], end=CUT)])
    b = ScriptedUpstream("b", [Answer(chunks=stream(*rest))], continue_final_message=True)
    return a, b


async def test_a_cut_stream_continues_with_the_dialects_continuation_body() -> None:
    a, b = _cut_then_continued(["Hello", " wor"], ["ld", "!"])
    rig = Rig([a, b], RESUME)
    retried = _retries("midstream", "retried")
    route = await rig.route()
    assert route.recorded
    error, got = await rig.relay(route)
    assert error is None
    assert _text(got) == "Hello world!" and _roles(got) == 1  # one seamless stream
    assert rig.parser.tally.done
    assert [s.path for s in b.sent] == [CHAT.path]
    assert b.sent[0].body == CHAT.continuation(rig.obj, "Hello wor", 2)
    sent = orjson.loads(b.sent[0].body)
    assert sent["messages"][-1] == {"role": "assistant", "content": "Hello wor"}
    assert sent["continue_final_message"] is True
    assert _retries("midstream", "retried") == retried + 1
    await rig.close(route)


async def test_a_continuation_on_another_upstream_does_not_back_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    backoffs: list[int] = []

    def recorded(attempt: int, base: float, cap: float, rng: object = None) -> float:
        backoffs.append(attempt)
        return 0.0

    monkeypatch.setattr(attempt_mod, "backoff", recorded)
    a, b = _cut_then_continued(["Hello", " wor"], ["ld", "!"])
    rig = Rig([a, b], RESUME)
    route = await rig.route()
    try:
        error, _ = await rig.relay(route)
        assert error is None and len(b.sent) == 1
        assert backoffs == [], "backed off before sending to a different upstream"
    finally:
        await rig.close(route)


async def test_recovery_is_off_once_the_record_overflowed() -> None:
    delta = "x" * 4096
    n = RECORD_MAX_BYTES // len(delta) + 1  # one delta past the bound
    a, b = _cut_then_continued([delta] * n, ["never sent"])
    rig = Rig([a, b], RESUME)
    dropped = _sample("tokenpipe_recovery_record_dropped_total")
    route = await rig.route()
    assert route.recorded
    error, got = await rig.relay(route)
    assert error is not None and error.code == "upstream_stream_truncated"
    assert _text(got) == delta * n  # the client got every delta: only the record went
    assert b.sent == []  # no continuation without the text so far
    assert rig.parser.recorded() == ("", 0)
    assert _sample("tokenpipe_recovery_record_dropped_total") == dropped + 1
    await rig.close(route)


async def test_cancel_raises_the_callers_cancellation_even_in_the_step_the_task_ends() -> None:
    """The client leaving while the race closes a loser: the reader's own cancellation must
    not be taken for the loser's (it was swallowed, and the reader read a whole stream for
    a client that was gone, holding the request open)."""
    from tokenpipe.router.route import cancel

    async def loser() -> None:
        await asyncio.Event().wait()

    task = asyncio.create_task(loser())
    caller = asyncio.create_task(cancel(task))
    await asyncio.sleep(0)  # one loop step (not a timed wait): the caller is in cancel()
    caller.cancel()  # in the step the loser ends with its own cancellation
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert task.cancelled()
