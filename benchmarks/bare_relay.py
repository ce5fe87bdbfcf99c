"""The floor for any Python gateway: a byte-forwarding aiohttp relay, no parsing, no metrics.
Every POST under /v1/ is forwarded to the same path upstream, whatever its API.

python benchmarks/bare_relay.py --upstream http://127.0.0.1:9000 --port 0

`--cpu-us N` (a diagnostic, see overhead.py --burn-us) spins N microseconds of CPU on each
request before forwarding it: a relay with a gateway's per-request cost and nothing else.

`--read` (a diagnostic, request_cpu.py --reading-relay) reads what any gateway must and no
more: the request body decoded (orjson), and each answer's SSE events split and their JSON
decoded (msgspec, the usage and finish fields typed), then the bytes forwarded as received.
It is the floor for a Python hop that knows what went through it.
"""

import argparse
import asyncio
import time

import aiohttp
import msgspec
import orjson
from aiohttp import web

from tokenpipe import serving


# Annotations evaluated at once (no `from __future__ import annotations`): msgspec would look
# string ones up in sys.modules['__main__'], which under `python -m cProfile` is not this file.
class _Choice(msgspec.Struct):
    finish_reason: str | None = None


class _Chunk(msgspec.Struct):
    choices: list[_Choice] | None = None
    usage: dict[str, int] | None = None


_decode = msgspec.json.Decoder(_Chunk).decode


class _Reader:
    """The events of an SSE answer, split across reads, each one's JSON decoded; the usage
    and the stream's end kept, as a gateway keeps them (this relay does not act on them)."""

    def __init__(self) -> None:
        self.held = b""
        self.usage: dict[str, int] | None = None
        self.done = False

    def feed(self, chunk: bytes) -> None:
        *events, self.held = (self.held + chunk).split(b"\n\n")
        for event in events:
            data = event[6:] if event.startswith(b"data: ") else b""
            if data == b"[DONE]":
                self.done = True
            elif data:
                c = _decode(data)
                if c.usage:
                    self.usage = c.usage


def app(upstream: str, cpu_us: float = 0.0, read: bool = False) -> web.Application:
    session: aiohttp.ClientSession | None = None

    async def relay(request: web.Request) -> web.StreamResponse:
        nonlocal session
        if session is None:
            session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1024))
        body = await request.read()
        if read:
            orjson.loads(body)
        if cpu_us:
            end = time.perf_counter() + cpu_us / 1e6
            while time.perf_counter() < end:
                pass
        async with session.post(
            upstream + request.path, data=body, headers={"content-type": "application/json"}
        ) as up:
            resp = web.StreamResponse(
                status=up.status, headers={"content-type": up.headers["content-type"]}
            )
            await resp.prepare(request)
            if read:  # (a loop of its own: the bare relay's stays as it was)
                reader = _Reader()
                async for chunk in up.content.iter_any():
                    reader.feed(chunk)
                    await resp.write(chunk)
            else:
                async for chunk in up.content.iter_any():
                    await resp.write(chunk)
            await resp.write_eof()
            return resp

    a = web.Application()
    # Any API's POST (chat, completions, responses, messages, ...): the bytes are the same.
    a.router.add_post("/v1/{path:.+}", relay)
    return a


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--upstream", required=True, help="sim base URL without /v1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--cpu-us", type=float, default=0.0, help="CPU to spin per request (us)")
    p.add_argument("--read", action="store_true", help="decode the request and each event")
    args = p.parse_args()
    serving.run(
        serving.serve(
            app(args.upstream.rstrip("/"), args.cpu_us, args.read),
            "127.0.0.1",
            args.port,
            drain_seconds=1,
            name="bare relay",
        )
    )


if __name__ == "__main__":
    asyncio.set_event_loop_policy(None)
    main()
