"""Bad values on the command line are usage errors (exit code 2) naming the flag, found before
anything starts: not a port wrapped around, a traceback, a hang, or one failed request per try.
"""

from __future__ import annotations

import subprocess
import sys

import click
import pytest
from click.testing import CliRunner

from tokenpipe.cli import main

URL = "http://127.0.0.1:9/v1"  # never reached: every case fails while its flags are read

CASES = [
    # A port past 65535 wrapped around in the socket call (99999 listened on 34463); a
    # negative one failed with a traceback.
    (["serve", "--port", "99999"], "--port"),
    (["serve", "--grpc-port", "-5"], "--grpc-port"),
    (["sim", "--port", "65536"], "--port"),
    (["local", "--port", "-1"], "--port"),
    # Durations: nan passed click's range check, inf made a drain or a timeout endless.
    (["serve", "--drain-seconds", "-1"], "--drain-seconds"),
    (["serve", "--drain-grace-seconds", "nan"], "--drain-grace-seconds"),
    (["sim", "--ttft-ms", "inf"], "--ttft-ms"),
    (["sim", "--itl-ms", "-1"], "--itl-ms"),
    (["sim", "--rpm", "0"], "--rpm"),
    (["sim", "--bucket-seconds", "nan"], "--bucket-seconds"),
    (["local", "--max-queue-wait", "inf"], "--max-queue-wait"),
    (["local", "--threads", "10000"], "--threads"),  # ggml runs at most 512
    (["bench", URL, "--requests", "0"], "--requests"),
    (["bench", URL, "--rate", "-1"], "--rate"),  # was a traceback
    (["bench", URL, "--duration", "nan"], "--duration"),
    (["bench", URL, "--timeout", "inf"], "--timeout"),  # was an OverflowError per request
    (["bench", URL, "--burstiness", "0"], "--burstiness"),
    (["bench", URL, "--warmup", "-1"], "--warmup"),
    # Lists: an empty item was skipped, a word quoted Python's own error, and 10^8 users hung.
    (["bench", URL, "--concurrency", "1,,8"], "--concurrency"),
    (["bench", URL, "--concurrency", "a"], "--concurrency"),
    (["bench", URL, "--concurrency", "99999999"], "--concurrency"),
    (["bench", URL, "--temperature", "nan"], "--temperature"),
    (["bench", URL, "--slo", "ttft=-5ms"], "bad duration"),
    (["doctor", URL, "--sweep", "0"], "--sweep"),
    (["doctor", URL, "--temperature", "3"], "--temperature"),
    (["doctor", URL, "--stall-factor", "0.5"], "--stall-factor"),
    (["doctor", URL, "--timeout", "inf"], "--timeout"),  # was a traceback
    (["doctor", URL, "--profile", "-1"], "--profile"),
    # A fault that went backwards or forever ran; an empty rate quoted Python's error.
    (["sim", "--fault", "reset:-5@0.1"], "bad fault spec 'reset:-5'"),
    (["sim", "--fault", "stall:1:inf@0.1"], "bad fault spec"),
    (["sim", "--fault", "stall-first:1e400@0.1"], "bad fault spec"),
    (["sim", "--fault", "stall-first:10@"], "fault rate must be a number"),
    # A memory size below 0 printed a batch of -1; nan or past a float's range, a traceback.
    (["kv", "--model", "llama-3.1-8b", "--memory", "-5GiB"], "--memory"),
    (["kv", "--model", "llama-3.1-8b", "--memory", "1e400GB"], "--memory"),
    (["kv", "--model", "llama-3.1-8b", "--memory", "abc"], "--memory"),
    # Upstream URLs that were a traceback at start-up (or at the first request), or that no
    # path can be added to.
    (["serve", "--upstream", "http://[::1"], "not a valid upstream URL"),
    (["serve", "--upstream", "http://x:99999/v1"], "not a valid upstream URL"),
    (["serve", "--upstream", "http://:80/v1"], "needs http:// or https:// and a host"),
    (["serve", "--upstream", "http://h/v1?x=1"], "no ?query or #fragment"),
    (["serve", "--upstream", "http://h /v1"], "may not hold spaces"),
    # A file written at the end, into a directory that does not exist: a traceback after
    # the whole run, its results lost.
    (["bench", URL, "--json", "/nonexistent-dir/run.json"], "/nonexistent-dir does not exist"),
    (["bench", URL, "--html", "/nonexistent-dir/run.html"], "--html"),
    (["doctor", URL, "--json", "/nonexistent-dir/d.json"], "--json"),
    (["doctor", URL, "--profile-out", "/nonexistent-dir/f.svg"], "--profile-out"),
    (["kv", "--model", "llama-3.1-8b", "--json", "/nonexistent-dir/kv.json"], "--json"),
    (["bench", URL, "--protocol", "grpc", "--grpc-url", "127.0.0.1:99999"], "--grpc-url"),
    (["doctor", URL, "--grpc-url", "h:0"], "--grpc-url"),
    # A header name that is no header name failed every request instead.
    (["bench", URL, "--header", ":x"], "--header"),
    (["doctor", URL, "--header", "a b:c"], "--header"),
    # A URL that is not http(s) failed every request instead.
    (["bench", "notaurl"], "URL must be an http(s) URL"),
    (["doctor", "ftp://x"], "URL must be an http(s) URL"),
]


@pytest.mark.parametrize(("args", "named"), CASES, ids=[" ".join(c[0]) for c in CASES])
def test_a_bad_value_is_a_usage_error_naming_its_flag(args: list[str], named: str) -> None:
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    assert named in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


@pytest.mark.parametrize("command", ["bench", "doctor"])
def test_a_grpc_url_whose_port_is_a_superscript_is_parsed_not_a_crash(command: str) -> None:
    """ "²" is a digit to `str.isdigit` and no number to `int` (found by the CLI fuzz test):
    the port check must not raise on it."""
    group_ctx = click.Context(main, info_name="tokenpipe")
    cmd = main.get_command(group_ctx, command)
    assert cmd is not None
    ctx = cmd.make_context(command, [URL, "--grpc-url", "h:\u00b2"], parent=group_ctx)
    assert ctx.params["grpc_url"] == "h:\u00b2"


def test_a_header_value_is_never_quoted_back() -> None:
    secret = "Bearer sk-" + "s" * 40
    for value in (f"Authorization:{secret}\r\nX: y", secret):
        result = CliRunner().invoke(main, ["bench", URL, "--header", value])
        assert result.exit_code == 2, result.output
        assert "sk-" not in result.output


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["serve", "--host", "no such host", "--upstream", URL], "cannot listen on 'no such host'"),
        (["serve", "--host", "192.0.2.1", "--upstream", URL], "192.0.2.1 is not an address of"),
        (["sim", "--host", "192.0.2.1", "--port", "0"], "192.0.2.1 is not an address of"),
    ],
)
def test_an_address_this_machine_cannot_listen_on_is_one_line(args: list[str], said: str) -> None:
    # Each was a socket.gaierror or OSError traceback. 192.0.2.1 is TEST-NET-1 (RFC 5737):
    # never an address of this machine.
    done = subprocess.run(
        [sys.executable, "-m", "tokenpipe", *args], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"tokenpipe: {said}"), done.stderr
    assert "Traceback" not in done.stderr


def test_credentials_in_an_upstream_url_are_refused_and_never_quoted(tmp_path) -> None:
    config = tmp_path / "gw.yaml"
    config.write_text("upstreams:\n  - {name: a, url: 'http://user:s3cret@h/v1'}\n")
    for args in (
        ["serve", "--upstream", "http://user:s3cret@h/v1"],
        ["config", "check", str(config)],
    ):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 2, result.output
        assert "may not hold credentials" in result.output
        assert "s3cret" not in result.output


@pytest.mark.parametrize("command", ["bench", "doctor"])
def test_a_key_with_a_line_break_is_a_usage_error_before_any_request(command: str) -> None:
    # Each request failed on it ("Forbidden control character detected in headers").
    result = CliRunner().invoke(main, [command, URL], env={"TOKENPIPE_API_KEY": "sk-s3cret\nX: y"})
    assert result.exit_code == 2, result.output
    assert "--api-key" in result.output and "line break" in result.output
    assert "s3cret" not in result.output


def test_a_key_that_is_not_utf8_is_a_usage_error() -> None:
    # Bytes that are not UTF-8 in the environment reach Python as surrogates; every request
    # failed on them.
    result = CliRunner().invoke(main, ["bench", URL], env={"TOKENPIPE_API_KEY": "sk-\udcff"})
    assert result.exit_code == 2, result.output
    assert "is not valid UTF-8" in result.output
