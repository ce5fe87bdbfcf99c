"""The bounded recovery record (relay/events.py `Record`) on its own: the text of a stream's
content deltas, kept for a continuation after a cut, up to RECORD_MAX_BYTES; past it dropped
and counted; its bytes in the stream buffer gauge only while the stream lasts."""

from __future__ import annotations

from tests.scripted_upstream import MODEL, content
from tokenpipe.dialects import CHAT
from tokenpipe.observe import metrics
from tokenpipe.relay.buffer import Accumulator
from tokenpipe.relay.events import RECORD_MAX_BYTES, EventParser, Record
from tokenpipe.relay.tally import StreamTally


def _sample(name: str) -> float:
    return metrics.REGISTRY.get_sample_value(name) or 0.0


def _parser() -> EventParser:
    """A stream's parser that records, as the router's reader sets it up."""
    parser = EventParser(StreamTally("-", MODEL, 0.0), False, CHAT)
    parser.record = Record()
    return parser


def test_a_record_past_its_bound_is_dropped_counted_and_leaves_the_buffer_gauge() -> None:
    before = Record.total_bytes
    dropped = _sample("tokenpipe_recovery_record_dropped_total")
    parser = _parser()
    assert [p.text for p in parser.feed(content("abc"))] == ["abc"]
    assert parser.texts() == ["abc"] and Record.total_bytes == before + 3
    gauge = _sample("tokenpipe_stream_buffer_bytes")
    assert gauge == Accumulator.total_bytes + Record.total_bytes  # the record counts in it
    delta = "y" * 4096
    n = RECORD_MAX_BYTES // len(delta)  # with "abc", the last of these passes the bound
    passed = [p for _ in range(n - 1) for p in parser.feed(content(delta))]
    assert len(parser.texts()) == n  # up to the bound, everything is kept
    assert Record.total_bytes == before + 3 + (n - 1) * len(delta)
    passed += parser.feed(content(delta))
    assert len(passed) == n  # the content itself still passes
    assert parser.record is None and parser.texts() == []
    assert _sample("tokenpipe_recovery_record_dropped_total") == dropped + 1
    assert Record.total_bytes == before  # the dropped record's bytes left the gauge
    parser.close()
    assert Record.total_bytes == before


def test_a_record_leaves_the_buffer_gauge_when_its_stream_closes() -> None:
    before = Record.total_bytes
    parser = _parser()
    for text in ("one", " two", " three"):
        parser.feed(content(text))
    assert parser.texts() == ["one", " two", " three"]
    assert Record.total_bytes == before + len("one two three")
    parser.close()
    assert parser.texts() == [] and Record.total_bytes == before  # its part is back to 0
    parser.close()  # twice changes nothing
    assert Record.total_bytes == before


def test_empty_deltas_count_so_a_record_of_them_is_bounded_too() -> None:
    """A reasoning or tool-call delta records the text "" (a token for the continuation's
    remainder): each counts 1 against the bound, so endless ones end the record as text
    does instead of growing its list without bound."""
    before = Record.total_bytes
    record = Record()
    assert record.add(["", "ab", ""]) and record.size == 4
    assert record.add([""] * (RECORD_MAX_BYTES - 4)) and len(record.texts) == RECORD_MAX_BYTES - 1
    assert not record.add([""])  # past the bound: spent
    assert record.texts == [] and record.size == 0 and Record.total_bytes == before
