"""Hostile config files: whatever YAML an operator (or a template gone wrong) writes, loading
it either gives Settings or a ConfigError with a message; never another exception, which
`serve` and `config check` would show as a traceback."""

from __future__ import annotations

import math
import re
from pathlib import Path

import msgspec
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenpipe import config_file
from tokenpipe.settings import MAX_MODELS, MAX_UPSTREAMS

SECTIONS = ["server", "auth", "upstreams", "limits", "keys", "context"]
KEYS = [
    "host",
    "port",
    "grpc_port",
    "max_body_bytes",
    "drain_seconds",
    "read_timeout_seconds",
    "cors_origins",
    "access_log",
    "api_keys",
    "name",
    "url",
    "sha256",
    "models",
    "backend",
    "redis",
    "rpm",
    "tpm",
    "policy",
    "window",
    "unknown",
]
scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True)
    | st.text(max_size=30)
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(KEYS), inner, max_size=4)
    ),
    max_leaves=15,
)
documents = st.dictionaries(st.sampled_from(SECTIONS + KEYS), values, max_size=5)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(doc=documents)
def test_any_yaml_document_loads_or_fails_with_a_config_error(tmp_path: Path, doc: dict) -> None:
    path = tmp_path / "gw.yaml"
    path.write_text(yaml.safe_dump(doc))
    try:
        loaded = config_file.load(path)
    except config_file.ConfigError as e:
        assert str(e).startswith(f"{path}: ")
    else:
        assert all(math.isfinite(x) for x in _floats(msgspec.to_builtins(loaded)))


def _floats(value: object) -> list[float]:
    if isinstance(value, float):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list):
        return [x for item in value for x in _floats(item)]
    return []


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ("server: {read_timeout_seconds: .inf}", "$.server.read_timeout_seconds"),
        ("server: {drain_seconds: .inf}", "$.server.drain_seconds"),
        ("keys: {alice: {rpm: .inf}}", "$.keys.alice.rpm"),
        (
            "upstreams: [{name: a, url: 'http://x/v1', read_timeout_seconds: .inf}]",
            "$.upstreams[0].read_timeout_seconds",
        ),
    ],
)
def test_an_infinite_number_is_refused_where_it_stands(
    tmp_path: Path, text: str, where: str
) -> None:
    path = tmp_path / "gw.yaml"
    path.write_text(text)
    with pytest.raises(config_file.ConfigError, match=f"finite number - at `{re.escape(where)}`"):
        config_file.load(path)


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(raw=st.binary(max_size=300))
def test_any_bytes_load_or_fail_with_a_config_error(tmp_path: Path, raw: bytes) -> None:
    path = tmp_path / "gw.yaml"
    path.write_bytes(raw)
    try:
        config_file.load(path)
    except config_file.ConfigError as e:
        assert str(e).startswith(f"{path}: ")


def test_an_upstream_key_loses_the_blanks_around_it_and_may_not_break_a_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "gw.yaml"
    path.write_text("upstreams: [{name: a, url: 'http://h/v1', api_key_env: TP_TEST_KEY}]")
    # A key read from a file or a mounted secret ends with a newline: it was a traceback at
    # start-up ("contains a line break"); blanks around it went into the header.
    monkeypatch.setenv("TP_TEST_KEY", " sk-abc123\n")
    assert config_file.load(path).upstreams[0].api_key() == "sk-abc123"
    monkeypatch.setenv("TP_TEST_KEY", "sk-abc\r\nX-Forged: 1")
    with pytest.raises(config_file.ConfigError, match=r"\$TP_TEST_KEY holds a line break") as e:
        config_file.load(path)
    assert "sk-abc" not in str(e.value)
    monkeypatch.setenv("TP_TEST_KEY", " \n")
    assert config_file.load(path).upstreams[0].api_key() is None


_MODELS = ", ".join(f"m{i}" for i in range(MAX_MODELS + 1))


@pytest.mark.parametrize(
    ("yaml", "where"),
    [
        # One upstream named 1,001 more times by an alias (each use is checked anew)
        (
            "upstreams: [&u {name: a, url: 'http://h/v1', models: [m1, m2]}"
            + ", *u" * MAX_UPSTREAMS
            + "]",
            "$.upstreams",
        ),
        # A list of models past its bound, anchored on one upstream and named by another
        (
            f"upstreams: [{{name: a, url: 'http://h/v1', models: &m [{_MODELS}]}},"
            " {name: b, url: 'http://h/v1', models: *m}]",
            "$.upstreams[0].models",
        ),
    ],
)
def test_a_config_whose_aliases_multiply_it_is_refused_at_its_bound(
    tmp_path: Path, yaml: str, where: str
) -> None:
    """YAML's aliases let a small file name one list many times in another: 2,000 aliases of
    an upstream with 20,000 models (135 KB) took 12.5 s and 339 MB to refuse, and more would
    never end. Each list has a bound, checked before its entries."""
    path = tmp_path / "gw.yaml"
    path.write_text(yaml)
    with pytest.raises(config_file.ConfigError, match=f"length <= .* - at `{re.escape(where)}`"):
        config_file.load(path)
