"""clock.Timeout: asyncio.timeout's contract on the request path (its cheaper twin)."""

from __future__ import annotations

import asyncio

import pytest

from tokenpipe.clock import Timeout


async def _forever() -> None:
    await asyncio.Event().wait()


# `given`: the caller gives the task the block runs in (the reader's timers get it through
# the accumulator), instead of the lookup (`asyncio.current_task()`: a getpid in 3.11).
GIVEN = pytest.mark.parametrize("given", [False, True], ids=["looked-up", "given"])


@GIVEN
async def test_past_its_bound_the_block_raises_timeout_and_leaves_no_cancel(
    given: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    me = asyncio.current_task()
    assert me is not None
    if given:  # the given task is used: no lookup at all
        monkeypatch.setattr(asyncio, "current_task", lambda loop=None: None)
    timer = Timeout(0.001, me if given else None)
    with pytest.raises(TimeoutError), timer:
        await _forever()
    assert timer.expired()
    assert me.cancelling() == 0
    await asyncio.sleep(0)  # (a cancel left pending would be raised here)


@GIVEN
async def test_a_cancel_from_outside_stays_a_cancellation(given: bool) -> None:
    entered = asyncio.Event()

    async def guarded() -> None:
        with Timeout(60, asyncio.current_task() if given else None):
            entered.set()
            await _forever()

    task = asyncio.create_task(guarded())
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_an_outer_bound_that_ends_first_is_the_outer_ones() -> None:
    inner = Timeout(60)
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.001):
            with inner:
                await _forever()
    assert not inner.expired()


async def test_a_timeout_error_from_below_is_not_its_own() -> None:
    timer = Timeout(60)

    async def below() -> None:
        raise TimeoutError("a read timeout further down")

    with pytest.raises(TimeoutError, match="further down"), timer:
        await below()
    assert not timer.expired()


async def test_none_arms_nothing_and_an_unexpired_block_returns_its_value() -> None:
    with Timeout(None) as timer:
        await asyncio.sleep(0)
    assert not timer.expired()
    with Timeout(60):
        value = await asyncio.sleep(0, "done")
    assert value == "done"
