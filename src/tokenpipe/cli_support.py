"""Helpers shared by the `tokenpipe` command and the sub-commands in their own modules.

A low module on purpose: the sub-command modules import it, never `tokenpipe.cli` (which adds
their commands to its group), so the command line has no import cycle.
"""

from __future__ import annotations

import math
import os
import re
import sys
from collections.abc import Callable, Iterable
from typing import Any

import click


class _Port(click.IntRange):
    name = "port"  # `--port PORT` in --help, not `INTEGER RANGE`


#: A TCP port: 0 (any free one) to 65535. A larger number would wrap around in the socket
#: call (99999 listened on 34463) and a negative one failed with a traceback.
PORT = _Port(0, 65535)


class Number(click.FloatRange):
    """A finite number in a range: `nan` passes every comparison of `FloatRange` and `inf`
    turns a timeout into no timeout (or an OverflowError where it becomes an integer)."""

    name = "number"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return number


#: Seconds or milliseconds to wait, 0 included; and an amount that must be above 0.
DURATION = Number(min=0)
POSITIVE = Number(min=0, min_open=True)


def numbers(
    text: str, flag: str, kind: Callable[[str], float], low: float, high: float
) -> list[Any]:
    """A comma-separated list of `kind` (int or float) in [low, high], for a flag that sweeps
    (`--concurrency 1,8,64`); an empty item, a non-finite number or one out of range is a
    usage error naming the flag."""
    values = []
    for item in text.split(","):
        try:
            value = kind(item.strip())
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and low <= value <= high):
            noun, span = (
                ("integers", f"{low:,} to {high:,}")
                if kind is int
                else ("numbers", f"{low:g} to {high:g}")
            )
            raise click.UsageError(
                f"{flag} takes {noun} from {span}, comma-separated; got {item!r}"
            )
        values.append(value)
    return values


#: A header name: RFC 9110's token.
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")


def headers(values: Iterable[str], flag: str = "--header") -> dict[str, str]:
    """`NAME:VALUE` options as headers. A value is never quoted back: it may be a key."""
    found: dict[str, str] = {}
    for text in values:
        name, sep, value = text.partition(":")
        name, value = name.strip(), value.strip()
        if not sep or not _TOKEN.fullmatch(name):
            shown = f" {name!r}" if sep and len(name) <= 64 else ""
            raise click.UsageError(f"{flag}{shown}: use NAME:VALUE, NAME a header name")
        if any(c in value for c in "\r\n\0"):
            raise click.UsageError(f"{flag} {name}: a value may not hold CR, LF or NUL")
        found[name] = value
    return found


def api_key(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """`--api-key` (or its environment variable) without the blanks around it: a key read
    from a file often ends with a newline. One with a line break inside is a usage error,
    found before any request fails on it. The key is never quoted back."""
    from tokenpipe.urls import has_control_characters

    key = (value or "").strip()
    if has_control_characters(key):
        raise click.BadParameter("holds a line break or control character", ctx, param)
    try:
        key.encode()
    except UnicodeEncodeError:  # bytes that are not UTF-8, from the environment
        raise click.BadParameter("is not valid UTF-8", ctx, param) from None
    return key or None


def output_file(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """A file a command writes at its end (`--json`, `--html`): its directory must exist and be
    writable now, so a run's results are not lost to a typo after the run. '-': stdout."""
    if value is None or value == "-":
        return value
    folder = os.path.dirname(os.path.abspath(value))
    if not os.path.isdir(folder):
        raise click.BadParameter(f"the directory {folder} does not exist", ctx, param)
    if not os.access(folder, os.W_OK):
        raise click.BadParameter(f"the directory {folder} is not writable", ctx, param)
    return value


#: Header names whose values are secrets, by the words in them (`authorization`, `x-api-key`,
#: `api-key`, `x-auth-token`, a proxy's `proxy-authorization`, ...).
_SECRET_WORDS = ("auth", "key", "token", "secret", "cookie", "password")


def command_line(name: str, args: list[str]) -> str:
    """The command as typed, for a report (`--json`, `--html`), with every secret masked: the
    value of `--api-key` and of a `--header` whose name is a credential's. Bytes that are not
    UTF-8 (argv holds them as surrogates, which JSON cannot) are shown as U+FFFD."""
    import shlex

    shown: list[str] = []
    for arg in args:
        after = shown[-1] if shown else ""
        if after == "--api-key":
            arg = "***"
        elif arg.startswith("--api-key="):
            arg = "--api-key=***"
        elif after == "--header" or arg.startswith("--header="):
            prefix = "--header=" if arg.startswith("--header=") else ""
            header, sep, _ = arg.removeprefix(prefix).partition(":")
            if sep and any(w in header.lower() for w in _SECRET_WORDS):
                arg = f"{prefix}{header}:***"
        shown.append(arg)
    text = f"tokenpipe {name} " + shlex.join(shown)
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def grpc_target(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """`HOST:PORT` (or any gRPC target): a port past 65535 would wrap around, as a listening
    one did (99999 is 34463), and connect somewhere else."""
    if value:
        port = value.rpartition(":")[2]
        # (ASCII first: "²" is a digit to `isdigit` and not a number to `int`.)
        if port.isascii() and port.isdigit() and not 0 < int(port) <= 65535:
            raise click.BadParameter(f"port {port} is not in 1-65535", ctx, param)
    return value


def http_url(url: str, what: str = "URL") -> str:
    """An http(s) URL with a host, else a usage error (not one failed request per try)."""
    from tokenpipe.urls import url_problem

    if url_problem(url, base_url=False):
        raise click.UsageError(f"{what} must be an http(s) URL, e.g. http://127.0.0.1:8000/v1")
    return url


def fail(message: str) -> None:
    """A usage or start-up error: the message on stderr, exit status 2."""
    click.echo(f"tokenpipe: {message}", err=True)
    sys.exit(2)


def configure_logging(level: str, fmt: str = "text") -> None:
    from tokenpipe.observe import logs  # lazy: `--help` stays instant

    logs.configure(level, fmt)
