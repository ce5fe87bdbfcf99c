"""Log lines go to stderr from a thread of their own: a stderr nobody reads does not stop the
gateway (observe/log_writer.py). In process with a real pipe, then a real gateway whose
output pipe is read only up to its listening line."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import subprocess
import sys
import threading

import aiohttp

from tests import procs
from tokenpipe.observe import log_writer
from tokenpipe.observe.log_writer import ThreadedHandler

_LISTEN = re.compile(rb"listening on (http://[\d.]+:\d+)")


def _read_all(fd: int) -> bytes:
    out = []
    while chunk := os.read(fd, 1 << 16):
        out.append(chunk)
    return b"".join(out)


def _logger(handler: logging.Handler) -> logging.Logger:
    log = logging.getLogger(f"test.log_writer.{id(handler)}")
    log.propagate = False
    log.handlers = [handler]
    log.setLevel(logging.INFO)
    return log


def test_a_full_pipe_drops_and_counts_past_the_bound_and_loses_nothing_unsaid() -> None:
    r, w = os.pipe()
    handler = ThreadedHandler(w, max_lines=500)
    log = _logger(handler)
    sent = 5_000
    for i in range(sent):  # ~45 bytes a line: the pipe takes ~1,400, the deque 500
        log.info("line %05d %s", i, "x" * 30)  # returns: nobody reads the pipe yet
    assert handler.dropped > 0
    reader = threading.Thread(target=lambda: got.append(_read_all(r)))
    got: list[bytes] = []
    reader.start()
    handler.flush()  # the reader drains the pipe, the writer the deque
    log.info("after")
    handler.close()
    os.close(w)
    reader.join(10)
    lines = got[0].decode().splitlines()
    numbers = [int(x.split()[1]) for x in lines if x.startswith("line ")]
    assert numbers == sorted(numbers)  # in order
    assert lines[-1] == "after"
    said = 0
    for at, text in enumerate(lines):  # each note stands where its lines are missing
        if "log lines dropped here" in text:
            gap = int(text.split()[1])
            before, after = lines[at - 1], lines[at + 1]
            upto = int(before.split()[1])
            resume = int(after.split()[1]) if after != "after" else sent
            assert resume - upto - 1 == gap
            said += gap
    assert said == handler.dropped
    assert len(numbers) + said == sent  # every line written or counted as dropped


def test_flush_writes_everything_logged_before_it() -> None:
    r, w = os.pipe()
    handler = ThreadedHandler(w)
    log = _logger(handler)
    for i in range(300):
        log.info("n%d", i)
    handler.flush()
    os.set_blocking(r, False)
    data = os.read(r, 1 << 16)
    assert data.decode().splitlines() == [f"n{i}" for i in range(300)]
    handler.close()
    os.close(r)
    os.close(w)


def test_a_closed_stderr_is_not_an_error_of_the_logger() -> None:
    r, w = os.pipe()
    os.close(r)  # writes now fail with EPIPE (SIGPIPE is ignored by Python)
    handler = ThreadedHandler(w)
    log = _logger(handler)
    log.info("into nothing")
    handler.flush()
    assert handler._thread.is_alive()  # the writer survives it
    handler.close()
    os.close(w)


def _gateway_unread(sim_url: str) -> tuple[subprocess.Popen[bytes], str]:
    """A gateway whose output pipe is read up to its listening line, then never again."""
    args = ["serve", "--port", "0", "--grpc-port", "0", "--drain-grace-seconds", "0"]
    args += ["--upstream", f"{sim_url}/v1", "--access-log", "--log-level", "debug"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "tokenpipe", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        m = _LISTEN.search(line)
        if m:
            return proc, m.group(1).decode()
    proc.kill()
    raise AssertionError("the gateway did not start")


async def test_a_gateway_whose_stderr_nobody_reads_keeps_serving(sim: procs.Service) -> None:
    """The base wrote each access-log line on the event loop: once the pipe (64 KiB) was
    full, ~400 requests in, every request waited for a reader that never came."""
    proc, url = _gateway_unread(sim.url)
    assert proc.stdout is not None
    try:
        requests = 1_500  # each writes an access line and debug lines: ~300 KB in all
        assert requests <= log_writer.MAX_LINES  # so none is dropped
        chat = [{"role": "user", "content": "hi"}]
        body = {"model": "sim-model", "max_tokens": 1, "messages": chat}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:

            async def one() -> int:
                async with s.post(url + "/v1/chat/completions", json=body) as r:
                    await r.read()
                    return r.status

            statuses = []
            for _ in range(requests // 50):
                statuses += await asyncio.gather(*(one() for _ in range(50)))
            async with s.get(url + "/metrics") as r:
                metrics = await r.text()
        assert statuses == [200] * requests
        assert "tokenpipe_log_lines_dropped_total 0.0" in metrics
        proc.terminate()
        rest = proc.stdout.read()  # now drained: every line comes out at exit
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    access = [x for x in rest.splitlines() if b"tokenpipe.access" in x]
    assert len(access) == requests + 1  # and /metrics


_ACCESS_CHILD = r"""
import logging, sys
from tokenpipe.observe import logs
logs.configure("info", sys.argv[1])
assert logs._direct is not None  # the log thread is set up: access() writes to it directly
path = "/v1/chat/completions?api_key=sk-abcdefgh12345678"
fields = {"request_id": "req-1", "method": "POST", "path": path, "status": 200,
          "duration_ms": 1.234}
logs.access(f"POST {path} 200 1.2 ms", fields)
logs.ACCESS.info("%s %s %d %.1f ms", "POST", path, 200, 1.234, extra=fields)  # a record
"""


def test_an_access_line_written_directly_is_the_line_its_record_makes() -> None:
    """`logs.access` formats the line without a LogRecord: it is the line logging makes of
    the same record, key masked, in both formats (only the time differs)."""
    for fmt in ("text", "json"):
        done = subprocess.run(
            [sys.executable, "-c", _ACCESS_CHILD, fmt], capture_output=True, check=True
        )
        direct, through_logging = done.stderr.decode().splitlines()
        assert "sk-abcdefgh" not in direct and "[redacted]" in direct
        if fmt == "json":
            a, b = json.loads(direct), json.loads(through_logging)
            assert abs(a.pop("ts") - b.pop("ts")) < 5
            assert a == b
            assert a["logger"] == "tokenpipe.access" and a["status"] == 200
        else:
            stamp = len("2026-12-07 12:00:00,000")
            assert direct[stamp:] == through_logging[stamp:]
            assert direct[stamp:].startswith(" INFO tokenpipe.access: POST ")
            assert direct.endswith(" [request_id=req-1]")
            assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}", direct[:stamp])


def test_an_access_line_that_cannot_be_made_does_not_fail_the_request() -> None:
    """JSON cannot hold a lone surrogate: the line goes logging's way, whose handleError
    reports it, and `access` returns as for any other line."""
    child = (
        "import sys\nfrom tokenpipe.observe import logs\nlogs.configure('info', 'json')\n"
        "logs.access('bad', {'path': '\\ud800'})\nlogs.access('good', {'path': '/'})\n"
        "print('returned', flush=True)\n"
    )
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, check=True)
    assert done.stdout == b"returned\n"
    assert b"Logging error" in done.stderr  # reported, not raised
    assert b'"message":"good"' in done.stderr
