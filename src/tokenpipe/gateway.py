"""Builds and runs the gateway from a Settings object."""

from __future__ import annotations

import socket

from aiohttp import web

from tokenpipe import serving
from tokenpipe.front import http as front_http
from tokenpipe.pipeline import Gateway
from tokenpipe.router import Router
from tokenpipe.settings import Settings
from tokenpipe.upstream.http import HttpUpstream


def build(settings: Settings) -> web.Application:
    router = Router([HttpUpstream(u) for u in settings.upstreams])
    return front_http.build_app(Gateway(settings, router))


async def run(settings: Settings, sock: socket.socket | None = None) -> None:
    """`sock`: an already bound listening socket (serve --workers), else host:port."""
    app = build(settings)

    def draining() -> None:
        app[front_http.GATEWAY].draining = True

    await serving.serve(
        app,
        settings.server.host,
        settings.server.port,
        drain_seconds=settings.server.drain_seconds,
        name="tokenpipe gateway",
        on_draining=draining,
        sock=sock,
    )
