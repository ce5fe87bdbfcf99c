"""Logging: text or one JSON object per line, each carrying the request id of the request that
was being served when the line was written, and never an API key.

The request id travels in a context variable (set by the HTTP front for each request), so any
logger anywhere below the front adds it without being handed the request.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import time
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

import orjson
from aiohttp.abc import AbstractAccessLogger
from aiohttp.web import BaseRequest, StreamResponse

#: The id of the request being served in this task (None outside a request).
REQUEST_ID: ContextVar[str | None] = ContextVar("tokenpipe_request_id", default=None)

# Defence in depth: nothing logs a key on purpose, but a message that quotes a header or an
# upstream's error text could. Bearer tokens and OpenAI/Anthropic-style keys are masked.
_SECRETS = re.compile(
    r"(?i)(bearer\s+|api[_-]?key[\"'=:\s]+|x-api-key[\"'=:\s]+)[^\s\"',;]+"
    r"|\b(sk|rk|pk)-[A-Za-z0-9_\-]{8,}"
)


def redact(text: str) -> str:
    # Every match of _SECRETS holds "key", "bearer" or "k-" once case-folded (api key and
    # x-api-key hold "key"; sk-, rk-, pk- hold "k-"). Most lines hold none, and three C
    # searches of the folded text spare them the pattern's scan (~4.7 us an 80-character
    # access line, benchmarks/log_lines.py). casefold, not lower: the pattern's IGNORECASE
    # matches U+017F (long s) with "s" and U+212A (Kelvin) with "k", and casefold folds them too.
    folded = text.casefold()
    if "key" not in folded and "bearer" not in folded and "k-" not in folded:
        return text
    return _SECRETS.sub(lambda m: (m.group(1) or "") + "[redacted]", text)


class JsonFormatter(logging.Formatter):
    """`{"ts", "level", "logger", "message", "request_id"?, "exc"?, ...extra}` per line."""

    #: Attributes of every LogRecord; anything else on a record came from `extra=` and is kept.
    _STANDARD = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}

    def format(self, record: logging.LogRecord) -> str:
        extra = {k: v for k, v in record.__dict__.items() if k not in self._STANDARD}
        exc = self.formatException(record.exc_info) if record.exc_info else None
        return self.line(
            record.created, record.levelname, record.name, record.getMessage(), extra, exc
        )

    def line(
        self,
        created: float,
        level: str,
        name: str,
        message: str,
        extra: dict[str, Any],
        exc: str | None = None,
    ) -> str:
        """The line of a record of these parts, `extra` its fields from `extra=` (its
        request id among them); `access` writes one without a record."""
        out: dict[str, Any] = {
            "ts": round(created, 6),  # seconds since the epoch
            "level": level.lower(),
            "logger": name,
            "message": redact(message),
        }
        rid = _request_id(extra)
        if rid:
            out["request_id"] = redact(str(rid))
        # Every field is masked, not only the message: `extra=` carries client text too (the
        # path of an access-log line, a header value).
        for k, v in extra.items():
            if k not in out:
                out[k] = redact(v) if isinstance(v, str) else v
        if exc:
            out["exc"] = redact(exc)
        return orjson.dumps(out, default=_redacted_str).decode()


def _request_id(extra: dict[str, Any]) -> Any:
    """A line's request id: its record's (`extra=`), else the serving task's."""
    return extra.get("request_id") or REQUEST_ID.get()


def _redacted_str(value: object) -> str:
    return redact(str(value))


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")
        self._second = -1  # the second `_stamp` holds the text of
        self._stamp = ""

    def format(self, record: logging.LogRecord) -> str:
        text = redact(super().format(record))
        rid = getattr(record, "request_id", None) or REQUEST_ID.get()
        return f"{text} [request_id={rid}]" if rid else text

    def line(
        self,
        created: float,
        level: str,
        name: str,
        message: str,
        extra: dict[str, Any],
        exc: str | None = None,
    ) -> str:
        """`format`'s line of a record of these parts, with no exception (`access`)."""
        second = int(created)
        if second != self._second:  # formatTime's text, made once a second
            self._second = second
            self._stamp = time.strftime(self.default_time_format, self.converter(created))
        ms = int((created - second) * 1000)  # (as LogRecord's msecs: formatTime's ",%03d")
        text = redact(f"{self._stamp},{ms:03d} {level} {name}: {message}")
        rid = _request_id(extra)
        return f"{text} [request_id={rid}]" if rid else text


#: The access log (`--access-log`): a line a request.
ACCESS = logging.getLogger("tokenpipe.access")
#: What `access` writes through, once `configure` set up the log thread: its handler and
#: the formatter's `line`.
_direct: tuple[Any, Callable[..., str]] | None = None


def access(message: str, fields: dict[str, Any]) -> None:
    """One access-log line; the caller has checked that ACCESS is enabled for INFO. When
    `configure` set up the log thread and nothing else was hung on the loggers since, the
    line goes to it without a LogRecord: the line the record would make, for ~1/3 of the
    CPU (the record and logging's calls were ~800 bytecodes a line on the event loop,
    benchmarks/log_lines.py)."""
    direct = _direct
    root = logging.root.handlers
    if direct is None or ACCESS.handlers or len(root) != 1 or root[0] is not direct[0]:
        ACCESS.info("%s", message, extra=fields)
        return
    handler, line = direct
    try:
        text = line(time.time(), "INFO", ACCESS.name, message, fields)
    except Exception:  # (logging's way then: its handleError reports it; the request goes on)
        ACCESS.info("%s", message, extra=fields)
        return
    handler.put(text)


#: Set by configure() so that processes spawned from this one (serve --workers) log alike.
FORMAT_ENV = "TOKENPIPE_LOG_FORMAT"


def configure(level: str = "info", fmt: str = "text") -> None:
    """Replaces the root handlers: one stderr handler in the chosen format, written by a
    thread of its own (log_writer.py) when stderr is a file descriptor."""
    from tokenpipe.observe.log_writer import ThreadedHandler

    os.environ[FORMAT_ENV] = fmt
    # A record looks up no caller's frame, thread or process (the logging HOWTO's
    # "Optimization"): no format of ours shows them, and they were ~6 us of a record's ~19
    # on the event loop (benchmarks/log_lines.py).
    logging._srcfile = None
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    handler: logging.Handler
    try:
        handler = ThreadedHandler(sys.stderr.fileno())
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation: a test's capture
        handler = logging.StreamHandler(sys.stderr)
    formatter = JsonFormatter() if fmt == "json" else TextFormatter()
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
        if isinstance(h, ThreadedHandler):
            h.close()
    root.addHandler(handler)
    global _direct
    _direct = (handler, formatter.line) if isinstance(handler, ThreadedHandler) else None
    root.setLevel(level.upper())


class AccessLog(AbstractAccessLogger):
    """aiohttp's access log as one structured record per request on `tokenpipe.access`."""

    def log(self, request: BaseRequest, response: StreamResponse, time_taken: float) -> None:
        rid = request.get("request_id") or response.headers.get("x-request-id")
        self.logger.info(
            "%s %s %d %.1f ms",
            request.method,
            request.path,
            response.status,
            time_taken * 1000,
            extra={
                "request_id": rid,
                "method": request.method,
                "path": request.path,
                "status": response.status,
                "duration_ms": round(time_taken * 1000, 3),
            },
        )

    @property
    def enabled(self) -> bool:
        return self.logger.isEnabledFor(logging.INFO)
