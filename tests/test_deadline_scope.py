"""DeadlineScope keeps asyncio.timeout's contract: TimeoutError at the deadline, a cancellation
from elsewhere passes through, nothing happens when the block ends in time."""

from __future__ import annotations

import asyncio

import pytest

from tokenpipe.deadline_scope import DeadlineScope


async def test_a_block_past_its_deadline_raises_timeout_error() -> None:
    never = asyncio.Event()
    with pytest.raises(TimeoutError):
        with DeadlineScope(0.01) as scope:
            await never.wait()
    assert scope.expired
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0  # the scope's cancel was taken back
    await asyncio.sleep(0)  # the task goes on normally


async def test_a_block_that_ends_in_time_is_untouched_and_its_timer_is_gone() -> None:
    done = asyncio.Event()
    asyncio.get_running_loop().call_soon(done.set)
    with DeadlineScope(60) as scope:
        await done.wait()
    assert not scope.expired and scope._handle is None


async def test_none_is_no_deadline() -> None:
    with DeadlineScope(None) as scope:
        await asyncio.sleep(0)
    assert not scope.expired and scope._handle is None


async def test_a_cancel_from_elsewhere_stays_a_cancel() -> None:
    started = asyncio.Event()

    async def body() -> None:
        with DeadlineScope(60):
            started.set()
            await asyncio.Event().wait()

    task = asyncio.create_task(body())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_an_outer_cancel_racing_the_deadline_stays_a_cancel() -> None:
    """The deadline strikes, and the task is also cancelled from outside before it runs:
    the outer cancel must win (TimeoutError would swallow it)."""
    entered = asyncio.Event()
    scope = DeadlineScope(60)

    async def body() -> None:
        with scope:
            entered.set()
            await asyncio.Event().wait()

    task = asyncio.create_task(body())
    await entered.wait()
    scope._fire()  # the deadline strikes ...
    task.cancel()  # ... and so does an outer cancel, before the task runs again
    with pytest.raises(asyncio.CancelledError):
        await task
