"""Helpers shared by the `tokenpipe` command and the sub-commands in their own modules.

A low module on purpose: the sub-command modules import it, never `tokenpipe.cli` (which adds
their commands to its group), so the command line has no import cycle.
"""

from __future__ import annotations

import sys

import click


def fail(message: str) -> None:
    """A usage or start-up error: the message on stderr, exit status 2."""
    click.echo(f"tokenpipe: {message}", err=True)
    sys.exit(2)


def configure_logging(level: str, fmt: str = "text") -> None:
    from tokenpipe.observe import logs  # lazy: `--help` stays instant

    logs.configure(level, fmt)
