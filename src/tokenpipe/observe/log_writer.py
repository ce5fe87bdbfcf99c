"""Log lines written by a thread of their own, so the event loop never waits on stderr.

`logging.StreamHandler` writes on the thread that logs: in the gateway, the event loop. A
stderr that nobody reads (a supervisor that never drains the pipe, a terminal stopped with
Ctrl-S) fills its pipe (64 KiB on Linux) and the next write blocks, and with it every stream
the process serves. `--access-log` writes a line a request, and an upstream's 429 storm a
line a refusal: ~400 lines fill the pipe.

The line is formatted where it is logged (the request id is read from that task's context;
and under the GIL a formatting thread would take the same CPU from the loop), appended to a
deque, and written by a daemon thread (`_run`) with `os.write` on the descriptor itself: no
lock of `sys.stderr`'s buffer is held while a write waits, so nothing else that prints is
stopped by it, nor the interpreter's exit.

Bound: MAX_LINES lines waiting (~3 MiB at 300 bytes a line). Past it a line is dropped and
counted (`tokenpipe_log_lines_dropped_total`), and the next line kept is preceded by one
that says how many were dropped there. At exit `logging.shutdown` flushes what waits, for
at most FLUSH_SECONDS; what a pipe still full then has not taken is lost.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque

from tokenpipe.observe import metrics

#: Lines waiting to be written; past it new lines are dropped and counted.
MAX_LINES = 10_000
#: Lines joined into one write.
BATCH = 256
#: Longest `flush` (and so the process's exit) waits for the writer (seconds).
FLUSH_SECONDS = 2.0


class ThreadedHandler(logging.Handler):
    """Formats on the caller's thread, writes to `fd` on a daemon thread (module doc)."""

    def __init__(self, fd: int, max_lines: int = MAX_LINES) -> None:
        super().__init__()
        self.fd = fd
        self.max_lines = max_lines
        #: Written by the threads that log (append; a deque's append and len are atomic).
        self._lines: deque[str] = deque()
        #: Lines dropped, and of those the ones a line in the log already tells of.
        self.dropped = 0
        self._noted = 0
        self._wake = threading.Event()
        #: The writer holds lines it took and has not written (under `_done` when cleared).
        self._busy = False
        self._done = threading.Condition()  # notified after each write, for `flush`
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="tokenpipe-log", daemon=True)
        self._thread.start()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record)
        except Exception:
            self.handleError(record)
            return
        self.put(line)

    def put(self, line: str) -> None:
        """A formatted line, for the writer (dropped and counted past `max_lines`)."""
        lines = self._lines
        if len(lines) >= self.max_lines:
            self.dropped += 1
            metrics.LOG_LINES_DROPPED.inc()
            return
        if self.dropped != self._noted:  # lines were dropped here: the log says so, here
            gap = self.dropped - self._noted
            self._noted = self.dropped
            lines.append(f"tokenpipe: {gap} log lines dropped here: stderr was full")
        lines.append(line)
        if not self._wake.is_set():  # (set takes a lock: ~1 us; once a batch is enough)
            self._wake.set()

    def _run(self) -> None:
        lines = self._lines
        while True:
            self._wake.wait()
            self._wake.clear()  # before draining: a line appended meanwhile sets it again
            while lines:
                self._busy = True
                batch: list[str] = []
                while lines and len(batch) < BATCH:
                    batch.append(lines.popleft())
                write_all(self.fd, ("\n".join(batch) + "\n").encode("utf-8", "backslashreplace"))
                with self._done:
                    self._busy = False
                    self._done.notify_all()
            if self._closing:
                return

    def flush(self) -> None:
        """Waits, at most FLUSH_SECONDS, until every line appended so far is written."""
        if self._thread.is_alive():
            self._wake.set()
            with self._done:
                self._done.wait_for(lambda: not self._lines and not self._busy, FLUSH_SECONDS)

    def close(self) -> None:
        self._closing = True
        self.flush()  # (which wakes the writer: it drains, sees `_closing` and returns)
        super().close()


def write_all(fd: int, data: bytes) -> None:
    """`data` written to `fd` whole, by `os.write` (no lock of `sys.stderr`'s buffer held
    while it waits: the module doc). A closed descriptor loses what was left of it."""
    view = memoryview(data)
    try:
        while view:
            view = view[os.write(fd, view) :]
    except OSError:
        pass
