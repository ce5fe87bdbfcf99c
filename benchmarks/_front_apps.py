"""The same tiny SSE answer behind each HTTP/1.1 server that `front_servers.py` compares: read
the JSON body, answer 200 text/event-stream with a role chunk, one content chunk and
`[DONE]` (a 1-token chat stream, as the gateway's front writes it).

    python benchmarks/_front_apps.py tokenpipe PORT   # the gateway's own server (front/server.py)
    python benchmarks/_front_apps.py aiohttp PORT     # aiohttp's web server, StreamResponse
    granian --interface rsgi ... _front_apps:rsgi_app    # Granian (Rust), RSGI
    uvicorn --http httptools ... _front_apps:asgi_app     # uvicorn's httptools protocol, ASGI

The modules for granian and uvicorn load this file in their own venv: it imports nothing but
the standard library at the top.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

EVENTS = [
    b'data: {"id":"x","object":"chat.completion.chunk","choices":[{"index":0,'
    b'"delta":{"role":"assistant"}}]}\n\n',
    b'data: {"id":"x","object":"chat.completion.chunk","choices":[{"index":0,'
    b'"delta":{"content":"hi"},"finish_reason":"stop"}]}\n\n',
    b"data: [DONE]\n\n",
]
HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


async def rsgi_app(scope: Any, proto: Any) -> None:
    await proto()  # the whole body
    out = proto.response_stream(200, [(k.lower(), v) for k, v in HEADERS.items()])
    try:
        for event in EVENTS:
            await out.send_bytes(event)
    except Exception:  # RSGIProtocolClosed: wrk stopped mid-answer at the end of its run
        return


_ASGI_HEADERS = [(k.lower().encode(), v.encode()) for k, v in HEADERS.items()]


async def asgi_app(scope: Any, receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    more = True
    while more:
        more = (await receive()).get("more_body", False)
    await send({"type": "http.response.start", "status": 200, "headers": _ASGI_HEADERS})
    for event in EVENTS[:-1]:
        await send({"type": "http.response.body", "body": event, "more_body": True})
    await send({"type": "http.response.body", "body": EVENTS[-1], "more_body": False})


async def _tokenpipe(port: int) -> None:
    from tokenpipe.front.listener import Server
    from tokenpipe.front.wire import Request, StreamResponse

    async def answer(request: Request) -> StreamResponse:
        while await request.readany():  # the whole body, as the gateway's edge reads it
            pass
        resp = StreamResponse(200, HEADERS)
        await resp.prepare(request)
        resp.send(EVENTS[0])
        resp.send(EVENTS[1])
        resp.send(EVENTS[2], last=True)
        return resp

    await Server(None, answer).start("127.0.0.1", port)
    await asyncio.Event().wait()


async def _aiohttp(port: int) -> None:
    from aiohttp import web

    async def answer(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers=HEADERS)
        await resp.prepare(request)
        for event in EVENTS:
            await resp.write(event)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", answer)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    await asyncio.Event().wait()


if __name__ == "__main__":
    import uvloop

    which, port = sys.argv[1], int(sys.argv[2])
    uvloop.install()
    asyncio.run(_tokenpipe(port) if which == "tokenpipe" else _aiohttp(port))
