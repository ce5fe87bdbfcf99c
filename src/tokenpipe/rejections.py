"""Requests aiohttp's HTTP parser rejects (bad request line, bad headers, headers too long):
an OpenAI-shaped JSON error that echoes nothing the client sent, and one log line each, at
most `LOG_PER_SECOND` lines a second.

aiohttp answers these itself, before any middleware runs, in plain text quoting the input
and with one ERROR traceback per request (2,000 bad requests gave 2,000 tracebacks). Its
request handler is the only place that sees them, so the server's handler class is replaced.
"""

from __future__ import annotations

import logging
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_server import Server

from tokenpipe.errors import GatewayError
from tokenpipe.log_budget import LogBudget

log = logging.getLogger("tokenpipe.front")

#: Log lines a second about rejected requests; above it they are counted and the count is
#: logged with the next line that is written (a flood costs a few lines, not one per request).
LOG_PER_SECOND = 5


_BUDGET = LogBudget(log, every=1.0, lines=LOG_PER_SECOND)


class _JsonRejectingHandler(RequestHandler):
    def handle_error(
        self,
        request: Any,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if not isinstance(exc, HttpProcessingError) or status < 400 or status >= 500:
            return super().handle_error(request, status, exc, message)
        _BUDGET.warning(
            None,
            "rejected an unparsable HTTP request from %s: %s",
            request.remote,
            type(exc).__name__,
        )
        if request.writer.output_size > 0:
            raise ConnectionError("response already started")
        # The parser's message quotes the input: only the kind of mistake is named.
        err = GatewayError(
            status,
            f"The request is not valid HTTP/1.1 ({type(exc).__name__}).",
            code="invalid_http_request",
        )
        resp = web.Response(status=status, body=err.json(), content_type="application/json")
        resp.force_close()
        return resp


class _JsonRejectingServer(Server):
    def __call__(self) -> RequestHandler:
        return _JsonRejectingHandler(self, loop=self._loop, **self._kwargs)


class Runner(web.AppRunner):
    """An AppRunner whose connections answer parser rejections as JSON (see module doc)."""

    async def _make_server(self) -> Server:
        server = await super()._make_server()
        server.__class__ = _JsonRejectingServer  # same object and state, one method differs
        return server
