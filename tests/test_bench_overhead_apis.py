"""A smoke run of `benchmarks/overhead.py --api responses,messages` (a few seconds: two users,
two rounds, 8-token answers): every API has its four rows (direct, bare relay, tokenpipe native
and translated), each measured a positive TTFT with no failed request, the gateways' CPU per
request is reported, and the table fits 80 columns. The figures themselves mean nothing at
this size; the integrator runs the real benchmark."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent
APIS = ("responses", "messages")
ROLES = ("direct", "bare-relay", "native", "translated")


def test_overhead_by_api_has_every_row_with_positive_ttft_and_no_errors(tmp_path: Path) -> None:
    out = tmp_path / "overhead.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "overhead.py"),
            "--api",
            ",".join(APIS),
            "--litellm",
            "off",
            "--pace",
            "paced",
            "--concurrency",
            "2",
            "--rounds",
            "2",
            "--requests-per-user",
            "2",
            "--max-tokens",
            "8",
            "--ttft-ms",
            "5",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (table,) = json.loads(out.read_text())["results"]
    assert table["apis"] == list(APIS)
    rows = {(r["api"], r["role"]): r for r in table["rows"]}
    assert sorted(rows) == sorted((api, role) for api in APIS for role in ROLES)
    for (api, role), r in rows.items():
        assert r["requests_failed"] == 0, (api, role, r)
        assert r["requests_ok"] == 2 * 2 * 2, (api, role, r)  # users x per user x rounds
        assert r["ttft_p50_ms"] > 0 and r["ttft_p99_ms"] >= r["ttft_p50_ms"], (api, role)
        assert r["tokens_per_s"] > 0
        if role == "direct":
            assert r["cpu_ms_per_request"] is None
        else:
            assert r["cpu_ms_per_request"] is not None and r["cpu_ms_per_request"] >= 0
            assert r["vs_relay_ttft_p50_ms"] is not None or role == "bare-relay"
    assert [v["api"] for v in table["translated_vs_native"]] == list(APIS)
    lines = proc.stdout.splitlines()
    for api in APIS:
        for role in ROLES:
            assert any(line.split()[:2] == [api, role] for line in lines if line), (api, role)
    assert all(len(line) <= 80 for line in lines if not line.startswith("wrote ")), lines
