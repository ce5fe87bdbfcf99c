"""The container files, checked without a container engine (none runs here): the command the
image runs exists, the shipped gateway config passes `config check`, Prometheus scrapes the
gateway's port and path, Grafana is given the dashboard that docs/ ships, and the gateway's
traces reach Jaeger through the collector."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).parent.parent


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tokenpipe", *args], capture_output=True, text=True, timeout=60
    )


def _dockerfile_cmd() -> list[str]:
    text = (ROOT / "Dockerfile").read_text()
    entry = json.loads(re.search(r"^ENTRYPOINT (\[.*\])$", text, re.M).group(1))  # type: ignore[union-attr]
    cmd = json.loads(re.search(r"^CMD (\[.*\])$", text, re.M).group(1))  # type: ignore[union-attr]
    assert entry == ["tokenpipe"]
    return list(cmd)


def test_image_command_and_compose_commands_are_valid_cli_invocations() -> None:
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    commands = [_dockerfile_cmd()] + [
        s["command"]
        for s in compose["services"].values()
        if s.get("image", "").startswith("tokenpipe")
    ]
    for cmd in commands:
        sub = cmd[0]
        helptext = _cli(sub, "--help").stdout
        for flag in (a for a in cmd[1:] if a.startswith("--")):
            assert flag in helptext, (sub, flag)


def test_shipped_config_passes_check_and_matches_compose() -> None:
    out = _cli("config", "check", str(ROOT / "deploy" / "tokenpipe.yaml"))
    assert out.returncode == 0, out.stderr
    cfg = yaml.safe_load((ROOT / "deploy" / "tokenpipe.yaml").read_text())
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    services = compose["services"]
    gw = services["gateway"]
    assert f"{cfg['server']['port']}:{cfg['server']['port']}" in gw["ports"]
    assert cfg["upstreams"][0]["api_key_env"] in gw["environment"]
    assert cfg["limits"]["redis"]["url"].startswith("redis://redis:")
    grace = int(gw["stop_grace_period"].rstrip("s"))
    assert grace > cfg["server"]["drain_seconds"]  # streams drain before the runtime kills


def test_prometheus_scrapes_the_gateway_and_grafana_gets_the_dashboard() -> None:
    prom = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    cfg = yaml.safe_load((ROOT / "deploy" / "tokenpipe.yaml").read_text())
    job = prom["scrape_configs"][0]
    assert job["metrics_path"] == "/metrics"
    assert job["static_configs"][0]["targets"] == [f"gateway:{cfg['server']['port']}"]
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    mounts = compose["services"]["grafana"]["volumes"]
    for mount in mounts:
        assert (ROOT / mount.split(":", 1)[0]).exists(), mount
    dash = json.loads((ROOT / "docs" / "grafana-dashboard.json").read_text())
    assert any("tokenpipe_" in json.dumps(p) for p in dash["panels"])
    ds = yaml.safe_load((ROOT / "deploy" / "grafana" / "datasources.yaml").read_text())
    assert ds["datasources"][0]["url"] == "http://prometheus:9090"


def test_the_gateway_exports_traces_to_the_collector_and_the_collector_to_jaeger() -> None:
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    services = compose["services"]
    endpoint = services["gateway"]["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"]
    assert endpoint == "http://otel-collector:4318"  # OTLP/HTTP, the default protocol
    mount = services["otel-collector"]["volumes"][0]
    collector = yaml.safe_load((ROOT / mount.split(":", 1)[0]).read_text())
    assert collector["receivers"]["otlp"]["protocols"]["http"]["endpoint"].endswith(":4318")
    pipeline = collector["service"]["pipelines"]["traces"]
    (exporter,) = pipeline["exporters"]
    host = collector["exporters"][exporter]["endpoint"].split(":")[0]
    assert host in services and "4317" in services[host]["expose"]
