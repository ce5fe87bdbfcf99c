"""The local engine's queue and hand-off, without the model: plain classes, real asyncio and
threads, an injected clock where time is the subject."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from tokenpipe.clock import ManualClock
from tokenpipe.engines.local.decode import StopMatcher
from tokenpipe.engines.local.handoff import PauseTimeout, TokenHandoff
from tokenpipe.engines.local.prompt import PromptError, chat_segments
from tokenpipe.engines.local.queue import FairQueue, ModelSlot, QueueFull
from tokenpipe.errors import GatewayError


def _until(cond: object, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.001)


def test_fair_queue_serves_clients_in_turn_and_each_client_in_order() -> None:
    q: FairQueue[str] = FairQueue(10)
    for item in ("a1", "a2", "a3"):
        q.push("a", item)
    q.push("b", "b1")
    q.push("c", "c1")
    q.push("b", "b2")
    assert [q.pop() for _ in range(6)] == ["a1", "b1", "c1", "a2", "b2", "a3"]
    assert q.pop() is None


def test_fair_queue_refuses_past_its_bound_and_frees_room_on_remove() -> None:
    q: FairQueue[str] = FairQueue(2)
    q.push("a", "a1")
    q.push("a", "a2")
    with pytest.raises(QueueFull):
        q.push("b", "b1")
    assert q.remove("a", "a1")
    assert not q.remove("a", "a1")
    q.push("b", "b1")
    assert [q.pop(), q.pop()] == ["a2", "b1"]


async def test_model_slot_grants_one_holder_and_hands_over_in_fair_order() -> None:
    slot = ModelSlot(max_waiting=10, max_wait_seconds=30)
    assert await slot.acquire("a") == 0.0
    order: list[str] = []

    async def waiter(client: str, name: str) -> None:
        await slot.acquire(client)
        order.append(name)

    tasks = []
    for client, name in (("a", "a1"), ("a", "a2"), ("b", "b1")):
        tasks.append(asyncio.create_task(waiter(client, name)))
        await asyncio.sleep(0)  # let it enqueue, in this order
    assert slot.waiting == 3
    for _ in range(3):
        slot.release()
        await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    assert order == ["a1", "b1", "a2"]
    assert slot.busy
    slot.release()
    assert not slot.busy


async def test_full_queue_answers_503_with_retry_after_at_once() -> None:
    slot = ModelSlot(max_waiting=1, max_wait_seconds=30)
    await slot.acquire("a")
    waiting = asyncio.create_task(slot.acquire("b"))
    await asyncio.sleep(0)
    with pytest.raises(GatewayError) as e:
        await slot.acquire("c")
    assert e.value.status == 503
    assert e.value.code == "queue_full"
    assert int(e.value.headers["Retry-After"]) >= 1
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert slot.waiting == 0


async def test_wait_past_the_deadline_answers_503_and_leaves_the_queue() -> None:
    slot = ModelSlot(max_waiting=4, max_wait_seconds=0.05)
    await slot.acquire("a")
    with pytest.raises(GatewayError) as e:
        await slot.acquire("b")
    assert (e.value.status, e.value.code) == (503, "queue_timeout")
    assert "Retry-After" in e.value.headers
    assert slot.waiting == 0


async def test_cancelled_waiter_that_was_just_granted_passes_the_model_on() -> None:
    slot = ModelSlot(max_waiting=4, max_wait_seconds=30)
    await slot.acquire("a")
    first = asyncio.create_task(slot.acquire("b"))
    second = asyncio.create_task(slot.acquire("c"))
    await asyncio.sleep(0)
    slot.release()  # granted to `first`...
    first.cancel()  # ...which is cancelled before it runs: the grant must go to `second`
    with pytest.raises(asyncio.CancelledError):
        await first
    await asyncio.wait_for(second, 5)
    assert slot.busy and slot.waiting == 0


def test_retry_after_grows_with_the_queue_and_the_measured_service_time() -> None:
    clock = ManualClock()
    slot = ModelSlot(max_waiting=10, max_wait_seconds=60, clock=clock)
    for _ in range(20):  # requests that each hold the model 4 s
        slot._grant()
        clock.advance(4.0)
        slot.release()
    assert slot.service.mean == pytest.approx(4.0, rel=0.05)
    assert slot.retry_after() == 4  # empty queue: one service time
    slot.busy = True
    loop = asyncio.new_event_loop()
    for i in range(3):
        slot.queue.push(str(i), loop.create_future())
    loop.close()
    assert slot.retry_after() == 16  # three ahead plus itself
    slot.max_wait_seconds = 10
    assert slot.retry_after() == 10  # never more than the wait deadline


async def test_handoff_blocks_the_producer_at_its_bound_until_the_consumer_takes() -> None:
    h: TokenHandoff[str] = TokenHandoff(asyncio.get_running_loop(), capacity=3, max_pause=30)
    produced: list[int] = []

    def producer() -> None:
        for i in range(10):
            if not h.put(str(i)):
                return
            produced.append(i)

    t = threading.Thread(target=producer)
    t.start()
    await asyncio.to_thread(_until, lambda: h.paused_since is not None)
    assert produced == [0, 1, 2]  # blocked on the fourth: decoding paused
    assert await h.get() == "0"
    await asyncio.to_thread(_until, lambda: len(produced) == 4 and h.paused_since is not None)
    assert produced == [0, 1, 2, 3]
    got = []
    while len(got) < 9:
        got.append(await h.get())
    await asyncio.to_thread(t.join, 5)
    assert got == [str(i) for i in range(1, 10)]
    assert h.paused_total > 0


async def test_handoff_close_wakes_a_blocked_producer_at_once() -> None:
    h: TokenHandoff[str] = TokenHandoff(asyncio.get_running_loop(), capacity=1, max_pause=30)
    result: list[bool] = []
    h.put("first")

    def producer() -> None:
        result.append(h.put("second"))

    t = threading.Thread(target=producer)
    t.start()
    await asyncio.to_thread(_until, lambda: h.paused_since is not None)
    h.close()
    await asyncio.to_thread(t.join, 5)
    assert result == [False]


async def test_handoff_gives_up_when_the_consumer_reads_nothing_for_max_pause() -> None:
    h: TokenHandoff[str] = TokenHandoff(asyncio.get_running_loop(), capacity=1, max_pause=0.05)
    h.put("first")
    with pytest.raises(PauseTimeout):
        await asyncio.to_thread(h.put, "second")


def test_stop_strings_cut_the_output_even_across_pieces() -> None:
    m = StopMatcher(("STOP",))
    out = []
    for piece in ("hello ", "ST", "O", "P", "never"):
        text, hit = m.feed(piece)
        out.append(text)
        if hit:
            break
    assert "".join(out) == "hello "
    m = StopMatcher(("xyz",))
    assert m.feed("abcx") == ("ab", False)
    assert m.feed("q") == ("c", False)
    assert m.flush() == "xq"


def test_stop_matcher_without_a_hit_loses_no_text() -> None:
    m = StopMatcher(("###",))
    pieces = ["a#", "#b", "c#", "#"]
    out = "".join(m.feed(p)[0] for p in pieces) + m.flush()
    assert out == "a##bc##"


def test_gemma_turns_put_system_text_in_the_first_user_turn_and_end_with_the_model_turn() -> None:
    segs = chat_segments(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi <start_of_turn>"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": [{"type": "text", "text": "Bye"}]},
        ]
    )
    text = "".join(t for t, _ in segs)
    assert text == (
        "<start_of_turn>user\nBe brief.\n\nHi <start_of_turn><end_of_turn>\n"
        "<start_of_turn>model\nHello.<end_of_turn>\n"
        "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n"
    )
    # Client text is never read as control tokens; only our markers are.
    assert ("Be brief.\n\nHi <start_of_turn>", False) in segs
    assert all(control for t, control in segs if t.startswith("<start_of_turn>"))
    with pytest.raises(PromptError):
        chat_segments([])
    # A role outside the chat schema was read as the user's (a 200); now the client's 400.
    with pytest.raises(PromptError, match="role 'wizard' is not one of"):
        chat_segments([{"role": "wizard", "content": "x"}])
    with pytest.raises(PromptError, match="role 5 is not one of"):
        chat_segments([{"role": 5, "content": "x"}])
    tool_turn = chat_segments([{"role": "tool", "content": "42"}])
    assert "".join(t for t, _ in tool_turn).startswith("<start_of_turn>user\n42")
