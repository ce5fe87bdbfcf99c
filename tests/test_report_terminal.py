"""bench and doctor in a real 80-column terminal: a pseudo-terminal whose size is set with
TIOCSWINSZ (COLUMNS and LINES removed from the environment, so the width comes from the
terminal as it does for a user), against a real sim. No cell is cut to `…`, no line is wider
than the terminal. Also: every option has help, and x-sim-* headers sent to a gateway warn.
"""

from __future__ import annotations

import fcntl
import os
import re
import select
import struct
import subprocess
import sys
import termios
import time

import click

from tokenpipe.bench.cli import bench
from tokenpipe.doctor.cli import doctor

#: Control sequences rich writes to a terminal (colours, hyperlinks), stripped off the screen.
_CSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07\x1b]*(\x07|\x1b\\)")


def in_terminal(*args: str, cols: int = 80, timeout: float = 120.0) -> tuple[str, str]:
    """(screen text, stderr) of `python -m tokenpipe ARGS` run on a pty of `cols` columns."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 200, cols, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    env["TERM"] = "xterm-256color"
    p = subprocess.Popen(
        [sys.executable, "-m", "tokenpipe", *args],
        stdin=slave,
        stdout=slave,
        stderr=subprocess.PIPE,
        env=env,
    )
    os.close(slave)
    out = bytearray()
    deadline = time.monotonic() + timeout
    try:
        while True:
            ready, _, _ = select.select([master], [], [], max(0.0, deadline - time.monotonic()))
            assert ready, f"no output for {timeout} s: {out[-400:]!r}"
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not data:
                break
            out += data
        err = p.stderr.read().decode() if p.stderr else ""
        assert p.wait(timeout=30) == 0, out.decode(errors="replace") + err
    finally:
        os.close(master)
        if p.poll() is None:
            p.kill()
    return _CSI.sub("", out.decode()).replace("\r\n", "\n"), err


def assert_fits(screen: str, cols: int = 80) -> None:
    assert "\u2026" not in screen, screen
    lines = screen.splitlines()
    too_wide = [line for line in lines if len(line) > cols]
    assert not too_wide, "\n".join(too_wide)


def test_bench_table_fits_an_80_column_terminal_with_every_figure(sim):
    screen, _ = in_terminal(
        "bench", sim.url + "/v1", "--concurrency", "1,2,4", "--requests", "6", "--no-progress"
    )
    assert_fits(screen)
    for figure in ("TTFT p50", "ITL/tok p99", "ITL/chunk p50", "e2e p99", "tok/s ratio"):
        assert figure in screen, screen
    assert all(f"c={c}" in screen for c in (1, 2, 4))
    # Goodput without --slo would only repeat req/s.
    assert screen.count("no SLO") == 3, screen


def test_bench_wide_keeps_one_row_per_run(sim):
    screen, _ = in_terminal(
        "bench",
        sim.url + "/v1",
        "--concurrency",
        "1,2",
        "--requests",
        "4",
        "--no-progress",
        "--wide",
    )
    header = next(line for line in screen.splitlines() if "TTFT p50" in line)
    assert "goodput/s" in header and "\u2026" not in screen  # every column, none cut


def test_doctor_waterfall_fits_an_80_column_terminal_and_wraps_its_explanations(sim):
    screen, _ = in_terminal(
        "doctor", sim.url + "/v1", "--requests", "1", "--sweep", "", "--streams", "0"
    )
    assert_fits(screen)
    # Each explanation reads on as few lines as it can: the bar gives way to it (on a 40-wide
    # bar "TCP handshake" was split over two lines and long ones over seven).
    assert "TCP handshake" in screen and "TLS handshake" in screen, screen
    rows = [line for line in screen.splitlines() if line.startswith("\u2502")]
    assert len(rows) <= 20, screen  # 8 phases in 20 lines (35 with the 40-wide bar)
    flat = " ".join(screen.replace("\u2502", " ").split())
    for words in ("(usage, [DONE])", "first -> last content token"):
        assert words in flat, screen
    assert "\u2588" in screen  # the bar is still drawn


def test_every_bench_and_doctor_option_has_help():
    for cmd in (bench, doctor):
        bare = [
            p.name for p in cmd.params if isinstance(p, click.Option) and not (p.help or "").strip()
        ]
        assert not bare, f"{cmd.name}: options without help: {bare}"


def test_help_says_a_gateway_drops_sim_headers():
    for cmd in ("bench", "doctor"):
        p = subprocess.run(
            [sys.executable, "-m", "tokenpipe", cmd, "--help"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        text = " ".join(p.stdout.split())
        assert "x-sim-" in text and "a gateway drops them" in text, text


def _doctor(url: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "tokenpipe",
            "doctor",
            url,
            "--requests",
            "1",
            "--sweep",
            "",
            "--streams",
            "0",
            "--header",
            "x-sim-fault:stall:5:300",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_doctor_warns_when_sim_headers_go_to_a_gateway_and_not_at_the_sim(sim, gateway):
    through = _doctor(gateway.url + "/v1")
    assert through.returncode == 0, through.stderr
    warning = [line for line in through.stderr.splitlines() if "warning" in line]
    assert len(warning) == 1, through.stderr
    assert "x-sim-fault" in warning[0] and "gateway" in warning[0]
    assert "no findings" in through.stdout  # the trap the warning names: the stall never came
    direct = _doctor(sim.url + "/v1")
    assert direct.returncode == 0, direct.stderr
    assert "warning" not in direct.stderr
    assert "stall" in direct.stdout


def test_bench_warns_when_sim_headers_go_to_a_gateway(gateway):
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "tokenpipe",
            "bench",
            gateway.url + "/v1",
            "--requests",
            "2",
            "--warmup",
            "0",
            "--no-progress",
            "--header",
            "x-sim-itl-ms:2",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    assert "x-sim-itl-ms" in p.stderr and "gateway" in p.stderr
