"""The front's listening socket: accepts connections for front/server.py's HttpConnection
and closes them at shutdown."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from tokenpipe.front.server import Access, Handler, HttpConnection
from tokenpipe.front.wire import Request


class Server:
    """Listens and serves `handler` on every connection; `shutdown` closes them."""

    def __init__(
        self,
        app: Any,
        handler: Handler,
        *,
        idle_seconds: float = 75.0,
        keepalive_seconds: float = 75.0,
        access: Access | None = None,
        decorate: Callable[[Request, dict[str, str]], None] | None = None,
    ) -> None:
        self.app = app
        self.handler = handler
        self.idle_seconds = idle_seconds
        self.keepalive_seconds = keepalive_seconds
        self.access = access
        self.decorate = decorate
        self.connections: set[HttpConnection] = set()
        self._server: asyncio.Server | None = None

    async def start(self, host: str, port: int, sock: Any = None, backlog: int = 2048) -> int:
        """Starts listening (on `sock` if given); returns the bound port."""
        loop = asyncio.get_running_loop()
        if sock is not None:
            self._server = await loop.create_server(
                lambda: HttpConnection(self), sock=sock, backlog=backlog
            )
        else:
            self._server = await loop.create_server(
                lambda: HttpConnection(self), host, port, backlog=backlog, reuse_address=True
            )
        return int(self._server.sockets[0].getsockname()[1])

    async def shutdown(self, timeout: float = 1.0) -> None:
        """Stops listening; closes idle connections at once and the rest when their answer
        ends, cancelling what is still open after `timeout` seconds."""
        if self._server is not None:
            self._server.close()
            self._server = None
        tasks = [t for conn in list(self.connections) if (t := conn.close_when_done())]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=timeout)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=timeout)
        for conn in list(self.connections):
            conn.transport.close()
