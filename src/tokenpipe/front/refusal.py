"""What the front's HTTP/1.1 server answers a request it cannot parse or that breaks the head
bounds (front/server.py): the error, naming the kind of mistake and never the client's bytes,
and at most LOG_PER_SECOND log lines a second (a flood of garbage logs a few lines, then
a count)."""

from __future__ import annotations

import logging

from tokenpipe.errors import GatewayError
from tokenpipe.log_budget import LogBudget
from tokenpipe.rejections import LOG_PER_SECOND

log = logging.getLogger("tokenpipe.front")

_BUDGET = LogBudget(log, every=1.0, lines=LOG_PER_SECOND)


class Refused(Exception):
    """A head over its bounds (raised inside a parser callback), with its status: 414 for
    the request line (RFC 9112 3), 431 for the headers (RFC 6585 5)."""

    def __init__(self, what: str, status: int = 431) -> None:
        super().__init__(what)
        self.status = status


def refusal(error: Exception, peer: object) -> GatewayError:
    """The answer to `error` (a Refused, else the parser's error: a 400), logged within the
    budget with the client's address (`peer`: the transport's peername, or None)."""
    kind = str(error) if isinstance(error, Refused) else type(error).__name__
    status = error.status if isinstance(error, Refused) else 400
    host = peer[0] if isinstance(peer, tuple) and peer else "-"
    _BUDGET.warning(None, "rejected an unparsable HTTP request from %s: %s", host, kind)
    return GatewayError(
        status, f"The request is not valid HTTP/1.1 ({kind}).", code="invalid_http_request"
    )
