"""A busy port at start-up is one line and exit code 2, never a traceback; and the gateway's
gRPC port is its own (grpcio's default SO_REUSEPORT would let a second gateway share it)."""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from tests import procs
from tokenpipe.engines.local.model import installed

#: Upper bound on a failing start (seconds): none of these loads a model.
START_LIMIT = 60


@contextlib.contextmanager
def _listener(reuse_port: bool = False) -> Iterator[int]:
    """A loopback port some other program listens on."""
    with socket.socket() as s:
        if reuse_port:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        yield int(s.getsockname()[1])


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tokenpipe", *args],
        capture_output=True,
        text=True,
        timeout=START_LIMIT,
        stdin=subprocess.DEVNULL,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def _assert_one_line(result: subprocess.CompletedProcess[str], port: int, flag: str) -> None:
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert "Traceback" not in output, output
    lines = output.strip().splitlines()
    assert len(lines) <= 3, output
    want = f"tokenpipe: port {port} is in use (another tokenpipe?); use {flag}"
    assert want in lines, output


def test_a_busy_http_port_is_one_line_and_exit_code_2() -> None:
    with _listener() as port:
        result = _run("serve", "--upstream", "http://127.0.0.1:9/v1", "--port", str(port))
    _assert_one_line(result, port, "--port")


def test_a_busy_http_port_with_workers_is_one_line_and_exit_code_2() -> None:
    with _listener(reuse_port=True) as port:  # even a port that allows sharing is not shared
        result = _run(
            "serve", "--upstream", "http://127.0.0.1:9/v1", "--workers", "2", "--port", str(port)
        )
    _assert_one_line(result, port, "--port")


def test_a_busy_grpc_port_is_one_line_and_exit_code_2() -> None:
    with _listener() as port:
        result = _run(
            "serve", "--upstream", "http://127.0.0.1:9/v1", "--port", "0", "--grpc-port", str(port)
        )
    _assert_one_line(result, port, "--grpc-port")


def test_a_busy_sim_port_is_one_line_and_exit_code_2() -> None:
    with _listener() as port:
        result = _run("sim", "--port", str(port))
    _assert_one_line(result, port, "--port")


@pytest.mark.skipif(not installed(), reason="the `local` extra is not installed")
def test_a_busy_local_port_is_one_line_and_exit_code_2() -> None:
    with _listener() as port:
        result = _run("local", "--port", str(port))
    _assert_one_line(result, port, "--port")


@pytest.mark.skipif(not installed(), reason="the `local` extra is not installed")
def test_serve_without_upstream_checks_its_ports_before_starting_the_model() -> None:
    """`make run` on a busy port: the one line, and the model was never started."""
    for flag in ("--port", "--grpc-port"):
        with _listener() as port:
            other = "--grpc-port" if flag == "--port" else "--port"
            result = _run("serve", flag, str(port), other, "0")
        _assert_one_line(result, port, flag)
        output = result.stdout + result.stderr
        assert "[local]" not in output and "local model" not in output, output


def test_a_second_gateway_does_not_share_the_first_ones_grpc_port() -> None:
    """grpcio turns SO_REUSEPORT on by default: a second gateway (or anything else that asks
    for sharing) would bind the same port and the kernel would split gRPC clients between them.
    The gateway's gRPC socket refuses sharing, and a second gateway says the port is busy."""
    with _listener() as probe:
        pass  # a free port number (closed again): the first gateway's gRPC port
    port = probe
    with procs.gateway("--upstream", "http://127.0.0.1:9/v1", "--grpc-port", str(port)) as first:
        assert f"gRPC listening on 127.0.0.1:{port}" in first.output()
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            with pytest.raises(OSError) as e:
                s.bind(("127.0.0.1", port))
            assert e.value.errno == errno.EADDRINUSE
        second = _run(
            "serve", "--upstream", "http://127.0.0.1:9/v1", "--port", "0", "--grpc-port", str(port)
        )
        _assert_one_line(second, port, "--grpc-port")
