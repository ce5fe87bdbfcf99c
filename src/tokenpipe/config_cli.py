"""`tokenpipe config check FILE`: validates a config without starting anything.

Errors are the same exact messages `serve` would stop with (msgspec names the path:
`Expected `int`, got `str` - at `$.server.port``); warnings are things that load but are
probably not meant (a key's environment variable unset, limits for an upstream that does not
exist).
"""

from __future__ import annotations

import os
import sys

import click


@click.group()
def config() -> None:
    """Check configuration files (see docs/config.md)."""


@config.command()
@click.argument("path", type=click.Path(dir_okay=False), metavar="FILE")
def check(path: str) -> None:
    """Validate FILE: exit 0 if `serve --config FILE` would accept it, else 2 with the reason."""
    from tokenpipe import config_file

    try:
        cfg = config_file.load(path)
    except config_file.ConfigError as e:
        click.echo(f"tokenpipe: {e}", err=True)
        sys.exit(2)
    for line in warnings(cfg):
        click.echo(f"warning: {line}", err=True)
    click.echo(
        f"{path}: ok ({len(cfg.upstreams)} upstream(s), {len(cfg.auth.api_keys)} API key(s), "
        f"limits backend {cfg.limits.backend})"
    )


def warnings(cfg: object) -> list[str]:
    from tokenpipe.settings import Settings

    assert isinstance(cfg, Settings)
    out: list[str] = []
    names = {u.name for u in cfg.upstreams}
    for u in cfg.upstreams:
        if u.api_key_env and u.api_key_env not in os.environ:
            out.append(f"upstreams.{u.name}: environment variable {u.api_key_env} is not set")
    for name in cfg.limits.upstreams:
        if name not in names:
            out.append(f"limits.upstreams.{name}: no upstream is named {name!r}")
    tail = cfg.tail
    for where, low, high, low_name, high_name in (
        ("tail.ttft", tail.ttft.floor_seconds, tail.ttft.ceiling_seconds, "floor", "ceiling"),
        ("tail.stall", tail.stall.floor_seconds, tail.stall.ceiling_seconds, "floor", "ceiling"),
        (
            "tail.retries",
            tail.retries.backoff_base_seconds,
            tail.retries.backoff_cap_seconds,
            "backoff_base",
            "backoff_cap",
        ),
    ):
        if low > high:  # one side set, the other's default beyond it: the upper one wins
            out.append(
                f"{where}: {low_name}_seconds ({low:g}) is above {high_name}_seconds ({high:g}),"
                f" so {high_name}_seconds wins"
            )
    for model, order in cfg.tail.fallbacks.items():
        for name in order:
            if name not in names:
                out.append(f"tail.fallbacks.{model}: no upstream is named {name!r}")
    keys = {k.name for k in cfg.auth.api_keys} or {"anonymous"}
    for name in cfg.keys:
        if name != "*" and name not in keys:
            out.append(f"keys.{name}: no API key is named {name!r}")
    if not cfg.upstreams:
        out.append("no upstreams: `serve` will run the embedded local model")
    return out
