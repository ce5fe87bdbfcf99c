"""Fuzz (issue 16, items 1, 7, 8): generated upstream event streams mixing good chunks with
broken events, ignorable lines and raw bytes, split at random points into writes, through one
real gateway. Invariant: the client gets the good events' content in order, up to the first
fault, then one error event and nothing after it; or, with no fault, the whole stream and one
[DONE]. Never a traceback; a good request afterwards succeeds."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests import procs
from tests.hostile_upstream import DONE, HostileUpstream, Reply, chat_chunk, sse_reply
from tests.test_hostile_stream import _no_crash, _post

#: Events the relay cannot read: each is a fault wherever it comes.
FATAL = [
    b"data: {not json}\n\n",
    b"data: 1e999\n\n",
    b"data: " + b"[" * 1100 + b"]" * 1100 + b"\n\n",
    b'data: "a string"\n\n',
    b"data: [1, 2]\n\n",
    b'data: {"choices": [1e400]}\n\n',
]
#: Lines SSE clients ignore (unknown fields, comments): never a fault, never content.
NOISE = [b"x-junk: 1\n\n", b": keep-alive\n\n", b"id: 7\nretry: 10\n\n", b"\n\n"]

Item = tuple[str, bytes]  # ("good", text) | ("fatal"|"noise"|"wild", bytes)

ITEMS = st.one_of(
    st.integers(0, 999).map(lambda i: ("good", b"t%d " % i)),
    st.sampled_from(FATAL).map(lambda b: ("fatal", b)),
    st.sampled_from(NOISE).map(lambda b: ("noise", b)),
    # Raw bytes as a block of their own (between blank lines, so they cannot swallow a good
    # event, which SSE would rightly drop): a fault or ignorable, unknown in advance.
    st.binary(min_size=1, max_size=40).map(lambda b: ("wild", b"\n\n" + b + b"\n\n")),
)


class Current:
    """The reply the upstream gives next (the examples run one at a time)."""

    reply: Reply = sse_reply([DONE])


@pytest.fixture(scope="module")
def gateway() -> Iterator[procs.Service]:
    with (
        HostileUpstream(lambda req: Current.reply) as up,
        procs.gateway("--upstream", up.url + "/v1") as g,
    ):
        yield g


def _split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % len(data) for c in cuts} - {0})
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    items=st.lists(ITEMS, max_size=12),
    cuts=st.lists(st.integers(0, 1 << 16), max_size=8),
    chunked=st.booleans(),
)
def test_client_gets_a_prefix_then_one_error_or_the_whole_stream(
    gateway: procs.Service, items: list[Item], cuts: list[int], chunked: bool
) -> None:
    first = [("good", b"t-first ")]  # one good event first: the stream has started
    items = first + items
    body = b"".join(chat_chunk(v.decode()) if k == "good" else v for k, v in items)
    body += chat_chunk("", "stop") + DONE
    Current.reply = sse_reply(_split(body, cuts), chunked=chunked)
    got = asyncio.run(_post(gateway, "chat", "fuzz"))
    assert got.status == 200, got.body
    texts = got.texts()
    goods = [v.decode() for k, v in items if k == "good"]
    # Always: content is a prefix of the good texts in order, and one terminal, last. Text is
    # compared joined: a read holding many events is a backlog, which the relay may merge
    # into fewer events with the same text (relay/buffer.py DIRECT_MAX_PIECES).
    content = [t for t in texts if t not in ("$",) and not t.startswith("!")]
    assert "".join(goods).startswith("".join(content)), texts
    terminals = [t for t in texts if t == "$" or t.startswith("!")]
    assert len(terminals) == 1 and texts[-1] == terminals[0], texts
    if terminals[0] == "$":
        assert "".join(content) == "".join(goods), texts  # [DONE] only after the whole answer
    else:
        assert terminals[0] == "!upstream_protocol_error", texts
    if not any(k == "wild" for k, _ in items):  # then exactly where the first fault is
        kinds = [k for k, _ in items]
        if "fatal" in kinds:
            before = [v.decode() for k, v in items[: kinds.index("fatal")] if k == "good"]
            assert "".join(content) == "".join(before), texts
            assert terminals == ["!upstream_protocol_error"], texts
        else:
            assert "".join(content) == "".join(goods) and terminals == ["$"], texts
    _no_crash(gateway)
    Current.reply = sse_reply([chat_chunk("ok"), DONE])
    assert asyncio.run(_post(gateway, "chat", "good")).texts() == ["ok", "$"]
