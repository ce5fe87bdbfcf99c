"""Operations: `tokenpipe config check`, JSON logs whose request ids match `x-request-id`,
and the gateway's own OpenAPI description."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import aiohttp
import orjson
import pytest

from tests import procs

ROOT = Path(__file__).parent.parent


def _check(path: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tokenpipe", "config", "check", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


@pytest.mark.parametrize(
    ("yaml", "message"),
    [
        ("server:\n  port: eighty\n", "Expected `int`, got `str` - at `$.server.port`"),
        ("server:\n  prot: 80\n", "Object contains unknown field `prot` - at `$.server`"),
        ("server:\n  port: 70000\n", "Expected `int` <= 65535 - at `$.server.port`"),
        (
            "upstreams:\n  - name: a\n    url: ftp://x\n",
            "Expected `str` matching regex '^https?://' - at `$.upstreams[0].url`",
        ),
        (
            "upstreams:\n  - {name: a, url: 'http://x/v1'}\n  - {name: a, url: 'http://y/v1'}\n",
            "upstream names must be unique: a",
        ),
        (
            "limits:\n  backend: etcd\n",
            "Invalid enum value 'etcd' - at `$.limits.backend`",
        ),
        ("server: [\n", "not valid YAML"),
    ],
)
def test_config_check_names_the_exact_problem(tmp_path: Path, yaml: str, message: str) -> None:
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(yaml)
    out = _check(cfg)
    assert out.returncode == 2, out
    assert out.stderr.startswith(f"tokenpipe: {cfg}: "), out.stderr
    assert message in out.stderr, out.stderr


def test_config_check_accepts_a_good_file_and_warns_about_likely_mistakes(tmp_path: Path) -> None:
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(
        "upstreams:\n  - name: openai\n    url: https://api.openai.com/v1\n"
        "    api_key_env: TOKENPIPE_TEST_UNSET_KEY\n"
        "limits:\n  upstreams:\n    opneai: {rpm: 10}\n"
        "keys:\n  batch: {rpm: 5}\n"
        "tail:\n  fallbacks: {gpt-4o: [openai, azrue]}\n  ttft: {ceiling_seconds: 1}\n"
    )
    out = _check(cfg)
    assert out.returncode == 0, out.stderr
    assert f"{cfg}: ok (1 upstream(s), 0 API key(s), limits backend memory)" in out.stdout
    assert (
        "upstreams.openai: environment variable TOKENPIPE_TEST_UNSET_KEY is not set" in out.stderr
    )
    assert "limits.upstreams.opneai: no upstream is named 'opneai'" in out.stderr
    assert "keys.batch: no API key is named 'batch'" in out.stderr
    assert "tail.fallbacks.gpt-4o: no upstream is named 'azrue'" in out.stderr
    # The floor's default (2 s) is above the ceiling set: clamped, the ceiling wins.
    assert (
        "tail.ttft: floor_seconds (2) is above ceiling_seconds (1), so ceiling_seconds wins"
        in out.stderr
    )


def test_every_documented_example_config_passes_check(tmp_path: Path) -> None:
    """The YAML blocks of docs/config.md, each checked on its own (they are the reference)."""
    text = (ROOT / "docs" / "config.md").read_text()
    blocks = [b.split("```", 1)[0] for b in text.split("```yaml\n")[1:]]
    assert len(blocks) >= 4
    for i, block in enumerate(blocks):
        cfg = tmp_path / f"block{i}.yaml"
        cfg.write_text(block)
        out = _check(cfg)
        assert out.returncode == 0, (block, out.stderr)


async def test_json_log_request_ids_match_the_x_request_id_header(sim: procs.Service) -> None:
    with procs.gateway("--upstream", sim.url + "/v1", "--log-format", "json", "--access-log") as g:
        chat = {
            "model": "sim-model",
            "max_tokens": 2,
            "messages": [{"role": "user", "content": "x"}],
        }
        seen: dict[str, int] = {}
        async with aiohttp.ClientSession() as s:
            for headers, body in [
                ({"x-request-id": "client-chosen-1"}, chat),
                ({}, chat),  # the gateway makes one up
                ({"x-request-id": "bad id with spaces"}, chat),  # refused, replaced
                ({"x-request-id": "client-chosen-2"}, {**chat, "stream": True}),
                ({"x-request-id": "client-chosen-3"}, {"model": 5}),  # a 400 has one too
            ]:
                async with s.post(g.url + "/v1/chat/completions", json=body, headers=headers) as r:
                    await r.read()
                    seen[r.headers["x-request-id"]] = r.status
    assert "client-chosen-1" in seen and "client-chosen-2" in seen and "client-chosen-3" in seen
    assert "bad id with spaces" not in seen
    records = [orjson.loads(line) for line in g.output().splitlines() if line.startswith("{")]
    assert records, g.output()
    for rec in records:
        assert {"ts", "level", "logger", "message"} <= set(rec)
    access = {r["request_id"]: r for r in records if r["logger"] == "tokenpipe.access"}
    for rid, status in seen.items():
        assert rid in access, (rid, list(access))
        assert access[rid]["status"] == status
        assert access[rid]["path"] == "/v1/chat/completions"


async def test_openapi_json_is_served_and_its_schemas_are_openais(gateway: procs.Service) -> None:
    async with aiohttp.ClientSession() as s, s.get(gateway.url + "/openapi.json") as r:
        assert r.status == 200
        doc = await r.json()
    assert doc["openapi"].startswith("3.1")
    assert {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings",
            "/v1/messages", "/v1/messages/count_tokens", "/v1/models", "/healthz", "/readyz",
            "/metrics", "/openapi.json"} <= set(doc["paths"])  # fmt: skip
    assert "MIT licence" in doc["info"]["description"]
    official: dict[str, object] = {}
    for copy in ("openai-schemas.json", "openai-responses-schemas.json"):
        official.update(
            json.loads((ROOT / "tests" / "data" / copy).read_text())["components"]["schemas"]
        )
    for name, schema in doc["components"]["schemas"].items():
        assert schema == official[name], name


async def test_workers_log_json_too(sim: procs.Service) -> None:
    """`serve --workers 2 --log-format json`: the spawned workers log in the parent's format."""
    with procs.gateway(
        "--upstream", sim.url + "/v1", "--workers", "2", "--log-format", "json", "--access-log"
    ) as g:
        async with aiohttp.ClientSession() as s:
            for i in range(4):
                async with s.get(g.url + "/healthz", headers={"x-request-id": f"w-{i}"}) as r:
                    assert r.status == 200
    ids = {
        rec.get("request_id")
        for rec in (orjson.loads(x) for x in g.output().splitlines() if x.startswith("{"))
        if rec["logger"] == "tokenpipe.access"
    }
    assert {f"w-{i}" for i in range(4)} <= ids, g.output()[-2000:]
