import math

from tokenpipe.clock import ManualClock
from tokenpipe.control.flowgate import FlowGate


def test_without_grants_or_pace_a_stream_is_unlimited() -> None:
    gate = FlowGate(ManualClock())
    allowed, wait = gate.allowance()
    assert allowed >= 2**31 - 1 and wait == 0


def test_first_grant_of_zero_pauses_until_more_credit() -> None:
    gate = FlowGate(ManualClock())
    gate.grant(0)
    assert gate.allowance() == (0, math.inf)
    gate.grant(3)
    assert gate.allowance() == (3, 0.0)
    gate.consume(2)
    assert gate.allowance() == (1, 0.0)
    gate.consume(1)
    assert gate.allowance() == (0, math.inf)


def test_grants_add_up() -> None:
    gate = FlowGate(ManualClock())
    gate.grant(5)
    gate.grant(7)
    assert gate.allowance()[0] == 12


def test_pace_releases_tokens_at_the_rate() -> None:
    clock = ManualClock()
    gate = FlowGate(clock)
    gate.set_rate(100)  # tokens/s; burst 5 tokens
    assert gate.allowance() == (1, 0.0)  # the first token goes at once
    gate.consume(1)
    allowed, wait = gate.allowance()
    assert allowed == 0 and math.isclose(wait, 0.01)
    sent = 1
    for _ in range(100):  # one second in 10 ms steps
        clock.advance(0.01)
        n, _ = gate.allowance()
        gate.consume(n)
        sent += n
    assert 100 <= sent <= 102


def test_pace_burst_is_bounded_after_idle() -> None:
    clock = ManualClock()
    gate = FlowGate(clock)
    gate.set_rate(100)
    clock.advance(60)
    assert gate.allowance()[0] == 5  # 50 ms worth, not a minute's


def test_credit_and_pace_together_take_the_lower() -> None:
    clock = ManualClock()
    gate = FlowGate(clock)
    gate.set_rate(1000)
    gate.grant(2)
    clock.advance(1)
    assert gate.allowance()[0] == 2


def test_rate_zero_clears_the_pace() -> None:
    gate = FlowGate(ManualClock())
    gate.set_rate(10)
    gate.consume(1)
    assert gate.allowance()[0] == 0
    gate.set_rate(0)
    assert gate.allowance()[0] > 1000
