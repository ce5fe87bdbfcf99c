"""A small aiohttp app on a free loopback port in the test's own event loop: an upstream whose
every answer the test decides (the sim covers everything else)."""

from __future__ import annotations

import contextlib
import ssl
from collections.abc import AsyncIterator

from aiohttp import web


@contextlib.asynccontextmanager
async def serving(
    app: web.Application, ssl_context: ssl.SSLContext | None = None
) -> AsyncIterator[str]:
    """Serves `app` until the block ends (over TLS with `ssl_context`); yields its base URL,
    `http(s)://127.0.0.1:PORT`."""
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ssl_context)
        await site.start()
        scheme = "https" if ssl_context else "http"
        yield f"{scheme}://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()
