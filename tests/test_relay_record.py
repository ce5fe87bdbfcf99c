"""The bounded recovery record (relay/events.py `Record`) on its own: the text of a stream's
content deltas, kept for a continuation after a cut, up to RECORD_MAX_BYTES; past it dropped
and counted; its bytes in the stream buffer gauge only while the stream lasts."""

from __future__ import annotations

import tracemalloc

from tests.scripted_upstream import MODEL, content
from tokenpipe.dialects import CHAT
from tokenpipe.observe import metrics
from tokenpipe.relay.events import HELD, RECORD_MAX_BYTES, RECORD_RUN, EventParser, Record
from tokenpipe.relay.tally import StreamTally


def _sample(name: str) -> float:
    return metrics.REGISTRY.get_sample_value(name) or 0.0


def _parser() -> EventParser:
    """A stream's parser that records, as the router's reader sets it up."""
    parser = EventParser(StreamTally("-", MODEL, 0.0), False, CHAT)
    parser.record = Record()
    return parser


def test_a_record_past_its_bound_is_dropped_counted_and_leaves_the_buffer_gauge() -> None:
    before = HELD.recorded
    dropped = _sample("tokenpipe_recovery_record_dropped_total")
    parser = _parser()
    assert [p.text for p in parser.feed(content("abc"))] == ["abc"]
    assert parser.recorded() == ("abc", 1) and HELD.recorded == before + 3
    gauge = _sample("tokenpipe_stream_buffer_bytes")
    assert gauge == HELD.queued + HELD.recorded  # the record counts in it
    delta = "y" * 4096
    n = RECORD_MAX_BYTES // len(delta)  # with "abc", the last of these passes the bound
    passed = [p for _ in range(n - 1) for p in parser.feed(content(delta))]
    assert parser.recorded()[1] == n  # up to the bound, everything is kept
    assert HELD.recorded == before + 3 + (n - 1) * len(delta)
    passed += parser.feed(content(delta))
    assert len(passed) == n  # the content itself still passes
    assert parser.record is None and parser.recorded() == ("", 0)
    assert _sample("tokenpipe_recovery_record_dropped_total") == dropped + 1
    assert HELD.recorded == before  # the dropped record's bytes left the gauge
    parser.close()
    assert HELD.recorded == before


def test_a_record_leaves_the_buffer_gauge_when_its_stream_closes() -> None:
    before = HELD.recorded
    parser = _parser()
    for text in ("one", " two", " three"):
        parser.feed(content(text))
    assert parser.recorded() == ("one two three", 3)
    assert HELD.recorded == before + len("one two three")
    parser.close()
    assert parser.recorded() == ("", 0) and HELD.recorded == before  # its part is back to 0
    parser.close()  # twice changes nothing
    assert HELD.recorded == before


def test_empty_deltas_count_so_a_record_of_them_is_bounded_too() -> None:
    """A reasoning or tool-call delta records the text "" (a token for the continuation's
    remainder): each counts 1 against the bound, so endless ones end the record as text
    does instead of growing its list without bound."""
    before = HELD.recorded
    record = Record()
    assert record.add(["", "ab", ""]) and record.size == 4
    assert record.add([""] * (RECORD_MAX_BYTES - 4)) and record.deltas == RECORD_MAX_BYTES - 1
    assert not record.add([""])  # past the bound: spent
    assert record.text() == "" and record.size == record.deltas == 0
    assert HELD.recorded == before


def test_a_record_of_tiny_deltas_holds_about_its_text() -> None:
    """Each delta was kept as its own str (~50 bytes over its text): 256 KiB of 1-character
    deltas held ~15 MiB a stream, 1,024 streams ~15 GiB against a bound of 256 KiB each."""
    n = RECORD_MAX_BYTES // 2
    tracemalloc.start()
    try:
        record = Record()
        for i in range(n):  # a new 2-character str each, as decoded from an event
            assert record.add([f"{chr(97 + i % 26)}{i % 10}"])
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert held < 2 * RECORD_MAX_BYTES  # ~1.1x the text; kept one by one it was ~15x
    assert record.deltas == n and len(record.text()) == 2 * n
    record.clear()


def test_a_record_keeps_its_deltas_in_order_across_runs() -> None:
    record = Record()
    words = [f"w{i} " for i in range(3 * RECORD_RUN + 7)]
    for i in range(0, len(words), 5):
        assert record.add(words[i : i + 5])
    assert record.text() == "".join(words) and record.deltas == len(words)
    record.clear()
