"""Builds and runs the gateway from a Settings object."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

from aiohttp import web

from tokenpipe import serving
from tokenpipe.front import http as front_http
from tokenpipe.observe import otel
from tokenpipe.pipeline import Gateway
from tokenpipe.router import Router
from tokenpipe.settings import Settings
from tokenpipe.upstream.http import HttpUpstream


def build(settings: Settings) -> web.Application:
    router = Router([HttpUpstream(u) for u in settings.upstreams])
    return front_http.build_app(Gateway(settings, router))


async def run(settings: Settings, sock: socket.socket | None = None) -> None:
    """`sock`: an already bound listening socket (serve --workers), else host:port."""
    # OpenTelemetry from the OTEL_* environment (off without an endpoint), per process.
    otel.setup(settings.tracing.capture_content)
    try:
        await _run(settings, sock)
    finally:
        otel.shutdown()  # the spans still batched go out before the process exits


async def _run(settings: Settings, sock: socket.socket | None) -> None:
    app = build(settings)
    gw = app[front_http.GATEWAY]
    grpc_server: Any = None

    def draining() -> None:
        gw.draining = True

    warming: set[asyncio.Task[None]] = set()  # held until done (the loop keeps weak refs)

    async def start_grpc() -> None:
        nonlocal grpc_server
        task = asyncio.create_task(gw.context.lookup.warm())  # in a thread, while serving
        warming.add(task)
        task.add_done_callback(warming.discard)
        if settings.server.grpc_port:
            from tokenpipe.front import grpc as front_grpc  # grpc loads only when used

            grpc_server = await front_grpc.start_server(
                gw, settings.server.host, settings.server.grpc_port
            )

    async def stop_grpc() -> None:
        for task in warming:
            task.cancel()
        if grpc_server is not None:
            # Stops accepting, lets open streams finish for the drain time, then cancels them.
            await grpc_server.stop(settings.server.drain_seconds)

    await serving.serve(
        app,
        settings.server.host,
        settings.server.port,
        drain_seconds=settings.server.drain_seconds,
        name="tokenpipe gateway",
        on_draining=draining,
        extra_start=start_grpc,
        extra_stop=stop_grpc,
        sock=sock,
        # Also the deadline on a new connection's request headers (slowloris).
        idle_seconds=min(75.0, settings.server.read_timeout_seconds),
        access_log=settings.server.access_log,
        drain=lambda: app[front_http.DRAIN].run(
            settings.server.drain_grace_seconds, settings.server.drain_seconds
        ),
    )
