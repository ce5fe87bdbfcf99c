"""Fault injection into every step of `Call.close`: whatever a step raises, the upstream
limiter's permit and the key's concurrency slot come back (real TrafficControl, Limiter,
Ticket and Admission objects; the failing steps are the injected faults)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tokenpipe import config_file
from tokenpipe.context.budget import UNCHANGED
from tokenpipe.control.traffic import TrafficControl
from tokenpipe.pipeline import Call
from tokenpipe.relay.tally import StreamTally

STEPS = ("route", "tally", "limiter_aimd", "ctx")


class Boom(Exception):
    pass


class _Resp:
    def __init__(self, fail: bool) -> None:
        self.fail = fail
        self.closed = False

    def close(self) -> None:
        self.closed = True
        if self.fail:
            raise Boom("uresp.close")


class _Route:
    """The upstream response and every extra one (hedges, retries), closed as one step."""

    def __init__(self, fail: bool) -> None:
        self.uresp = _Resp(fail)
        self.upstream = _Upstream()

    def close(self) -> None:
        self.uresp.close()

    def client_expired(self) -> bool:
        return False


class _Tally(StreamTally):
    fail = False

    def finish(self, status: int) -> None:
        if self.fail:
            raise Boom("tally.finish")
        super().finish(status)


class _Ctx:
    def __init__(self, fail: bool) -> None:
        self.fail = fail
        self.headers: dict[str, str] = {}

    def observe(self, usage: Any) -> None:
        if self.fail:
            raise Boom("ctx.observe")


class _FailingAIMD:
    limit = 2.0

    def allows(self, inflight: int) -> bool:
        return inflight < 2

    def sample(self, inflight: int, dropped: bool) -> float:
        raise Boom("aimd.sample")


class _Upstream:
    name = "up"


def _traffic(tmp: Path) -> TrafficControl:
    cfg = tmp / "gw.yaml"
    cfg.write_text(
        "upstreams:\n  - name: up\n    url: http://127.0.0.1:9/v1\n"
        "limits:\n  adaptive_concurrency: false\n  max_concurrency: 2\n"
        "keys:\n  default: {max_concurrency: 1}\n"
    )
    return TrafficControl(config_file.load(cfg))


@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize(
    "usage", [None, {"prompt_tokens": "3", "completion_tokens": -7}, {"prompt_tokens": 1e400}]
)
async def test_every_permit_comes_back_whatever_a_close_step_raises(
    tmp_path: Path, step: str, usage: Any
) -> None:
    traffic = _traffic(tmp_path)
    limiter = traffic.limiters["up"]
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    for _ in range(5):  # more rounds than permits and key slots: a leak would block
        ticket = await traffic.admit("default", body)
        await ticket.acquire("up")
        assert limiter.inflight == 1
        conc = limiter.concurrency
        if step == "limiter_aimd":  # the limiter's bookkeeping fails while releasing
            limiter.concurrency = _FailingAIMD()  # type: ignore[assignment]
        tally = _Tally("up", "m", 0.0)
        tally.fail = step == "tally"
        tally.usage = usage
        route = _Route(step == "route")
        resp = route.uresp
        call = Call(
            route,  # type: ignore[arg-type]
            tally,
            ticket,
            _Ctx(step == "ctx"),  # type: ignore[arg-type]
        )
        with pytest.raises(Boom) if step != "none" else _nothing():
            call.close(503)  # a status the concurrency limit learns from
        assert resp.closed
        assert limiter.inflight == 0, step
        limiter.concurrency = conc
    await traffic.close()


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


async def test_a_bad_usage_alone_raises_nothing_and_is_treated_as_absent(tmp_path: Path) -> None:
    traffic = _traffic(tmp_path)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    for bad in ({"prompt_tokens": "3"}, {"completion_tokens": -1}, {"total_tokens": True}):
        ticket = await traffic.admit("default", body)  # the key allows one at a time
        await ticket.acquire("up")
        tally = StreamTally("up", "m", 0.0)
        tally.usage = dict(bad)
        call = Call(_Route(False), tally, ticket, UNCHANGED)  # type: ignore[arg-type]
        call.close(200)
        assert tally.usage is None
        assert traffic.limiters["up"].inflight == 0
    await traffic.close()
