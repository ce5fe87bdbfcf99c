"""A small aiohttp app on a free loopback port in the test's own event loop: an upstream whose
every answer the test decides (the sim covers everything else)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from aiohttp import web


@contextlib.asynccontextmanager
async def serving(app: web.Application) -> AsyncIterator[str]:
    """Serves `app` until the block ends; yields its base URL, `http://127.0.0.1:PORT`."""
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()
