"""The `tokenpipe` executable: the command line, with a Ctrl-C while it loads answered as
click answers one (`Aborted!`, exit code 1), not with a traceback through the imports."""

from __future__ import annotations

import sys


def main() -> None:
    try:
        from tokenpipe.cli import main as cli
    except KeyboardInterrupt:
        # Ctrl-C in the ~0.1 s the command line takes to import (click, the settings):
        # nothing has started, so there is nothing to stop or drain.
        sys.stderr.write("\nAborted!\n")
        sys.exit(1)
    for i, arg in enumerate(sys.argv[1:], 1):
        try:
            arg.encode()
        except UnicodeEncodeError:
            # Bytes that are not UTF-8 reach Python as lone surrogates, which no JSON body,
            # header, host name or report can hold: each was a traceback somewhere later.
            sys.stderr.write(f"tokenpipe: argument {i} is not valid UTF-8\n")
            sys.exit(2)
    cli()
