"""The CI-sized soak (benchmarks/soak.py for ~45 s): under a mixed workload with injected 429s,
stalls and resets, every request ends in an expected way, and once the load stops the gateway
returns to its idle level: no task, connection or in-flight request left behind."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent
CLIENTS = 8
#: Outcomes the workload can cause: served, a 429 the sim injected (passed on with
#: Retry-After), a stream cut by an injected reset (an SSE error event, then [DONE]).
EXPECTED = {"ok", "429", "cut"}


def test_short_soak_ends_every_request_cleanly_and_returns_to_idle(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "soak.py"),
            "--duration",
            "45",
            "--clients",
            str(CLIENTS),
            "--sample-seconds",
            "3",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["gateway_alive"]
    assert r["requests"] > 200
    unexpected = {k: v for k, v in r["outcomes"].items() if k.split(":", 1)[1] not in EXPECTED}
    assert not unexpected, unexpected
    assert sum(v for k, v in r["outcomes"].items() if k.endswith(":ok")) > 0.8 * r["requests"]
    before, after = r["idle_before"], r["idle_after"]
    assert after["inflight"] == 0
    assert after["tasks"] <= before["tasks"] + 2, (before["tasks"], after["tasks"])
    # Pooled keep-alive connections to the upstream may stay open (up to one per client).
    assert after["fds"] <= before["fds"] + 2 * CLIENTS + 4, (before["fds"], after["fds"])
    assert after["rss_mb"] < before["rss_mb"] + 64
    assert len(r["samples"]) >= 10
