"""A client that closes its connection: mid-stream its handler is cancelled (the upstream
stream closes), but once the stream's last event went out the handler is left to finish its
books, so a client that hangs up at [DONE] is recorded as answered, not as a 499. The front's
own server, in process, on a loopback socket."""

from __future__ import annotations

import asyncio

import pytest

from tests.polling import until
from tokenpipe.front.listener import Server
from tokenpipe.front.wire import Request, StreamResponse

REQUEST = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n"


@pytest.mark.parametrize("ended", [True, False], ids=["after-last-event", "mid-stream"])
async def test_a_close_cancels_the_handler_only_before_the_streams_last_event(
    ended: bool,
) -> None:
    release = asyncio.get_running_loop().create_future()
    outcome: list[str] = []
    statuses: list[int] = []

    async def handler(request: Request) -> StreamResponse:
        response = StreamResponse(200, {"Content-Type": "text/event-stream"})
        await response.prepare(request)
        request.sse = response
        response.send(b"data: [DONE]\n\n" if ended else b"data: {}\n\n", last=ended)
        try:
            await release  # the books after the last write (or the rest of the stream)
        except asyncio.CancelledError:
            outcome.append("cancelled")
            raise
        outcome.append("finished")
        return response

    server = Server(None, handler, access=lambda _r, status, _s: statuses.append(status))
    port = await server.start("127.0.0.1", 0)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(REQUEST)
        await asyncio.wait_for(reader.readuntil(b"data: "), 10)
        writer.close()  # the client hangs up as soon as it has read its event

        async def gone() -> bool:
            return not server.connections

        await until(gone, 10, "the server to see the close")
        if not release.done():  # (cancelled with the handler that awaited it)
            release.set_result(None)
        await until(lambda: asyncio.sleep(0, statuses), 10, "the access record")
        assert outcome == (["finished"] if ended else ["cancelled"])
        assert statuses == ([200] if ended else [499])
    finally:
        await server.shutdown()
