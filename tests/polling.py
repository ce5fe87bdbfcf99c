"""Waiting on a condition of a real process (bounded, polled: no fixed sleeps as
synchronisation) and reading a gateway's Prometheus samples."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

from tests import procs


async def until(cond: Callable[[], Awaitable[Any]], seconds: float, what: str) -> Any:
    """The first truthy value of `cond()`, polled every 50 ms for at most `seconds`."""
    deadline = time.monotonic() + seconds
    value = None
    while time.monotonic() < deadline:
        value = await cond()
        if value:
            return value
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what} (last: {value!r})")


async def metrics(gw: procs.Service) -> dict[str, float]:
    """Every sample of the gateway's /metrics, keyed by name and labels as exposed."""
    async with aiohttp.ClientSession() as s, s.get(gw.url + "/metrics") as r:
        text = await r.text()
    return {
        k: float(v)
        for k, v in (
            line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#")
        )
    }
