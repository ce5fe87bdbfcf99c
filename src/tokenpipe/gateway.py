"""Builds and runs the gateway from a Settings object."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import sys
from collections.abc import AsyncIterator
from typing import Any

from tokenpipe import serving
from tokenpipe.front import http as front_http
from tokenpipe.front.app import Front
from tokenpipe.front.listener import Server
from tokenpipe.observe import otel
from tokenpipe.observe.runtime import RuntimeSampler
from tokenpipe.pipeline import Gateway
from tokenpipe.router import Router
from tokenpipe.settings import Settings
from tokenpipe.upstream.http import HttpUpstream


def build(settings: Settings) -> tuple[Front, Server]:
    router = Router([HttpUpstream(u) for u in settings.upstreams])
    server = settings.server
    return front_http.build(
        Gateway(settings, router),
        # The deadline on a request's head (slowloris); the idle keep-alive is apart.
        idle_seconds=min(75.0, server.read_timeout_seconds),
        keepalive_seconds=server.keepalive_seconds,
        access=server.access_log,
    )


@contextlib.asynccontextmanager
async def running(
    settings: Settings, sock: socket.socket | None = None
) -> AsyncIterator[tuple[Front, Server, int]]:
    """The gateway started and listening (on `sock`, an already bound listening socket, or
    on host:port; port 0 picks one): yields (front, server, bound port); closes it all."""
    front, server = build(settings)
    gw = front.gateway
    await gw.start()
    sampler = RuntimeSampler()
    sampler.start()
    # The upstreams' model lists and windows, and the configured models' tokenizers (in a
    # thread), are learned while serving: before the first request, mostly.
    warm = asyncio.create_task(gw.warm())
    try:
        port = await server.start(settings.server.host, settings.server.port, sock)
        yield front, server, port
    finally:
        warm.cancel()
        await server.shutdown(1.0)
        await sampler.stop()
        await gw.close()


async def run(settings: Settings, sock: socket.socket | None = None) -> None:
    """`sock`: an already bound listening socket (serve --workers), else host:port."""
    # OpenTelemetry from the OTEL_* environment (off without an endpoint), per process.
    otel.setup(settings.tracing.capture_content)
    try:
        await _run(settings, sock)
    finally:
        otel.shutdown()  # the spans still batched go out before the process exits


async def _run(settings: Settings, sock: socket.socket | None) -> None:
    server_settings = settings.server
    grpc_server: Any = None
    async with running(settings, sock) as (front, _, port):
        gw = front.gateway
        if server_settings.grpc_port:
            from tokenpipe.front import grpc as front_grpc  # grpc loads only when used

            grpc_server = await front_grpc.start_server(
                gw, server_settings.host, server_settings.grpc_port
            )
        serving.settle_heap()  # start-up is done: out of the collector's way
        serving.announce(f"tokenpipe gateway listening on http://{server_settings.host}:{port}")
        stopped_by = await serving.until_signalled()
        drain = server_settings.drain_seconds
        # Ctrl-C (SIGINT) comes from a terminal, where no readiness probe waits to see the
        # 503s: open streams still finish, but the grace is not waited for.
        grace = 0.0 if stopped_by == signal.SIGINT else server_settings.drain_grace_seconds
        serving.announce(f"tokenpipe gateway draining (up to {drain:g} s)", sys.stderr)
        gw.draining = True
        # Both fronts drain at the same time, each within drain_seconds: gRPC stops
        # accepting, lets open streams finish, then cancels them.
        grpc_stop = (
            asyncio.ensure_future(grpc_server.stop(drain)) if grpc_server is not None else None
        )
        await front.drain.run(grace, drain)
        if grpc_stop is not None:
            await grpc_stop
