"""clock.Timeout: asyncio.timeout's contract on the request path (its cheaper twin)."""

from __future__ import annotations

import asyncio

import pytest

from tokenpipe.clock import Timeout


async def _forever() -> None:
    await asyncio.Event().wait()


async def test_past_its_bound_the_block_raises_timeout_and_leaves_no_cancel() -> None:
    timer = Timeout(0.001)
    with pytest.raises(TimeoutError), timer:
        await _forever()
    assert timer.expired()
    me = asyncio.current_task()
    assert me is not None and me.cancelling() == 0
    await asyncio.sleep(0)  # (a cancel left pending would be raised here)


async def test_a_cancel_from_outside_stays_a_cancellation() -> None:
    entered = asyncio.Event()

    async def guarded() -> None:
        with Timeout(60):
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


async def test_given_the_task_it_runs_in_it_bounds_it_as_when_it_looks_it_up() -> None:
    """The reader's timers are given its task (relay_stream's, through the accumulator):
    the same contract, without `asyncio.current_task()` (a getpid system call in 3.11)."""
    me = asyncio.current_task()
    timer = Timeout(0.001, me)
    with pytest.raises(TimeoutError), timer:
        await _forever()
    assert timer.expired() and me is not None and me.cancelling() == 0
    entered = asyncio.Event()

    async def guarded() -> None:
        with Timeout(60, asyncio.current_task()):
            entered.set()
            await _forever()

    task = asyncio.create_task(guarded())
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
