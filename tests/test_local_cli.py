"""`tokenpipe serve` with no upstream, on a machine without the `local` extra."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from tokenpipe.cli import main
from tokenpipe.engines.local import model


def test_serve_without_upstream_or_local_extra_says_how_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The one stand-in here: "not installed" cannot be produced on a machine that has the extra.
    monkeypatch.setattr(model, "installed", lambda: False)
    result = CliRunner().invoke(main, ["serve", "--port", "0", "--grpc-port", "0"])
    assert result.exit_code == 2
    assert "pip install 'tokenpipe[local]'" in result.output
    assert "--upstream URL" in result.output


def test_local_help_lists_the_bounds() -> None:
    result = CliRunner().invoke(main, ["local", "--help"])
    assert result.exit_code == 0
    for option in ("--max-queue", "--max-queue-wait", "--max-pause", "--handoff-tokens", "--port"):
        assert option in result.output
