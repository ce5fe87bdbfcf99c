"""Any text for any option of any command is parsed into a value the command can use (finite,
in its range) or refused as a usage error; never another exception. Parsing only: each command
is made into a context (every type and callback runs) and not invoked."""

from __future__ import annotations

import math

import click
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenpipe.cli import main

URL = "http://127.0.0.1:9/v1"
#: Arguments a command needs besides the option under test.
NEEDS = {"bench": [URL], "doctor": [URL], "kv": ["--model", "llama-3.1-8b"]}


def _options() -> list[tuple[str, str]]:
    ctx = click.Context(main)
    found = []
    for name in main.list_commands(ctx):
        command = main.get_command(ctx, name)
        assert command is not None
        for param in command.params:
            if isinstance(param, click.Option) and not param.is_flag and param.opts:
                if isinstance(param.type, click.Choice):
                    continue
                found.append((name, param.opts[0]))
    return found


OPTIONS = _options()
texts = (
    st.sampled_from(
        ["nan", "inf", "-inf", "-1", "0", "1e400", "99999999999", "", "1,,2", " ", "h:\u00b2"]
    )
    | st.floats(allow_nan=True).map(repr)
    | st.integers(min_value=-(2**70), max_value=2**70).map(str)
    # What argv can hold: no NUL (C strings), and of the surrogates only those that stand
    # for bytes that are not UTF-8 (Python decodes argv with surrogateescape: U+DC80-U+DCFF).
    | st.text(
        st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00")
        | st.characters(min_codepoint=0xDC80, max_codepoint=0xDCFF),
        max_size=12,
    )
)


@pytest.mark.parametrize(("command", "option"), OPTIONS, ids=[f"{c} {o}" for c, o in OPTIONS])
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(text=texts)
def test_any_value_of_an_option_parses_or_is_a_usage_error(
    command: str, option: str, text: str
) -> None:
    group_ctx = click.Context(main, info_name="tokenpipe")
    cmd = main.get_command(group_ctx, command)
    assert cmd is not None
    try:
        ctx = cmd.make_context(command, [*NEEDS.get(command, []), option, text], parent=group_ctx)
    except click.ClickException:
        return  # a usage error naming the option: what a bad value should get
    for value in ctx.params.values():
        if isinstance(value, float):
            assert math.isfinite(value), (option, text, value)
