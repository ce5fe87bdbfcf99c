"""A config file read into Settings, and the rules its types cannot say; `serve --upstream`'s
URLs made into upstreams. A mistake is a ConfigError naming where it is (the command line
prints it and exits 2)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import msgspec
from msgspec import Struct

from tokenpipe.settings import Settings, UpstreamSettings
from tokenpipe.urls import has_control_characters, normalise_base_url, url_problem


class ConfigError(Exception):
    pass


def load(path: str | Path) -> Settings:
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise ConfigError(f"cannot read config {path}: {e.strerror}") from None
    try:
        settings = msgspec.yaml.decode(raw, type=Settings)
    except msgspec.ValidationError as e:
        raise ConfigError(f"{path}: {e}") from None
    except msgspec.DecodeError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    try:
        check(settings)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    return settings


def check(settings: Settings) -> None:
    """Cross-field rules that types alone cannot say."""
    _finite(settings, "$")
    for i, upstream in enumerate(settings.upstreams):
        problem = url_problem(upstream.url)
        if problem:
            raise ConfigError(f"{problem} - at `$.upstreams[{i}].url`")
        key = upstream.api_key()
        if key and has_control_characters(key):
            # Never quoted: it is a secret. A line break in it would forge header lines.
            raise ConfigError(
                f"the key in ${upstream.api_key_env} holds a line break or control character,"
                f" which no header may - at `$.upstreams[{i}].api_key_env`"
            )
    names = [u.name for u in settings.upstreams]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ConfigError(f"upstream names must be unique: {', '.join(dupes)} - at `$.upstreams`")


def _finite(value: Any, path: str) -> None:
    """Every number is finite: YAML spells infinity `.inf`, which passes a lower bound and
    makes a timeout no timeout (or a bucket that never empties)."""
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ConfigError(f"Expected a finite number - at `{path}`")
    elif isinstance(value, Struct):
        for name in value.__struct_fields__:
            _finite(getattr(value, name), f"{path}.{name}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _finite(item, f"{path}[{i}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            _finite(item, f"{path}.{key}")


#: `--upstream` scheme prefixes naming the API an upstream speaks (a plain URL is OpenAI's).
API_PREFIXES = {"anthropic+": "anthropic", "openai+": "openai"}


def upstream_from_url(url: str, index: int) -> UpstreamSettings:
    """`serve --upstream URL`: a base URL with or without `/v1`, optionally prefixed by the
    API it speaks (`anthropic+https://api.anthropic.com/v1`)."""
    api = "openai"
    for prefix, name in API_PREFIXES.items():
        if url.startswith(prefix):
            api, url = name, url[len(prefix) :]
    problem = url_problem(url)
    if problem:
        raise ConfigError(f"--upstream: {problem}")
    try:
        return msgspec.convert(
            {"name": f"upstream{index}", "url": normalise_base_url(url), "api": api},
            UpstreamSettings,
        )
    except msgspec.ValidationError:
        raise ConfigError("--upstream: an upstream URL needs http:// or https://") from None
