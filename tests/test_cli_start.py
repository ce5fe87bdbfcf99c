"""The command line's start: sub-commands load when used, and a Ctrl-C while the command
line loads is click's `Aborted!`, not a traceback."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from click.testing import CliRunner

from tokenpipe.cli import main


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_help_lists_every_command_in_the_order_a_newcomer_meets_them() -> None:
    result = CliRunner().invoke(main, ["--help"])
    assert result.exit_code == 0, result.output
    rows = result.output.split("Commands:")[1].strip().splitlines()
    names = [row.split()[0] for row in rows]
    assert names == ["serve", "local", "sim", "bench", "doctor", "kv", "config"]


def test_a_command_in_its_own_module_runs() -> None:
    result = CliRunner().invoke(main, ["kv", "--help"])
    assert result.exit_code == 0, result.output
    assert "KV-cache memory" in result.output


def test_the_command_line_loads_no_sub_command_until_one_is_used() -> None:
    done = _python(
        """
        import sys
        import tokenpipe.cli
        loaded = [m for m in ("aiohttp", "tokenpipe.bench", "tokenpipe.doctor") if m in sys.modules]
        print(loaded)
        """
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_ctrl_c_while_the_command_line_loads_is_aborted_not_a_traceback() -> None:
    # The Ctrl-C arrives while `tokenpipe.cli` imports: an import hook raises it there, where
    # SIGINT's KeyboardInterrupt would be raised, without a race against the clock.
    done = _python(
        """
        import sys

        class CtrlC:
            def find_spec(self, name, path=None, target=None):
                if name == "tokenpipe.cli":
                    raise KeyboardInterrupt
                return None

        sys.meta_path.insert(0, CtrlC())
        sys.argv = ["tokenpipe", "--version"]
        from tokenpipe.launch import main
        main()
        """
    )
    assert done.returncode == 1
    assert done.stderr.strip() == "Aborted!"
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    "command", [[], ["serve"], ["sim"], ["local"], ["bench"], ["doctor"], ["kv"], ["config"]]
)
def test_every_help_fits_an_80_column_terminal(command: list[str]) -> None:
    result = CliRunner().invoke(main, [*command, "--help"], terminal_width=80)
    assert result.exit_code == 0, result.output
    assert [line for line in result.output.splitlines() if len(line) > 80] == []


def test_an_argument_that_is_not_utf8_is_refused_before_any_command_runs() -> None:
    # Such bytes reach Python as lone surrogates: a model name so was a TypeError for every
    # request, a host name a UnicodeError traceback, a report path a traceback after the run.
    done = subprocess.run(
        [sys.executable, "-m", "tokenpipe", "bench", "http://127.0.0.1:9/v1", "--model", b"m\xff"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert done.stderr.strip() == "tokenpipe: argument 4 is not valid UTF-8"
