"""No API key in any log line: this test drives a gateway through every path that touches a
key (valid, invalid, malformed, upstream key, errors) at debug level in both log formats, then
greps every log file the test suite's child processes wrote in this run.

Named to run after the other test modules (pytest runs files in order), so their gateways'
logs are on disk by then (bench.procs.Service saves each child's output when it stops).
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import psutil
import pytest

from tests import procs
from tokenpipe.bench.procs import LOG_DIR
from tokenpipe.control.auth import digest

CLIENT_KEY = "tpk-live-CLIENTSECRET-4c1b9e"
WRONG_KEY = "tpk-live-WRONGSECRET-77aa01"
UPSTREAM_KEY = "sk-proj-UPSTREAMSECRET-d00d5eed"
#: Anything shaped like a credential: a bearer token, an OpenAI-style key.
CREDENTIAL = re.compile(
    r"(?i)bearer\s+(?!\[redacted\]|YOUR_KEY)[A-Za-z0-9._\-]{6,}|\bsk-[A-Za-z0-9_\-]{8,}"
)


async def _drive(g: procs.Service) -> None:
    chat = {"model": "sim-model", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    async with aiohttp.ClientSession() as s:
        for auth, want in [
            (f"Bearer {CLIENT_KEY}", 200),
            (f"Bearer {WRONG_KEY}", 401),
            (f"Basic {CLIENT_KEY}", 401),
            (CLIENT_KEY, 401),
            (f"Bearer {UPSTREAM_KEY}", 401),
        ]:
            async with s.post(
                g.url + "/v1/chat/completions",
                json={**chat, "user": CLIENT_KEY},
                headers={"Authorization": auth},
            ) as r:
                assert r.status == want
                text = await r.text()
                assert CLIENT_KEY not in text and WRONG_KEY not in text and UPSTREAM_KEY not in text
        # A bad request and an upstream error while authenticated.
        async with s.post(
            g.url + "/v1/chat/completions",
            data=b"{broken",
            headers={"Authorization": f"Bearer {CLIENT_KEY}"},
        ) as r:
            assert r.status == 400
        async with s.post(
            g.url + "/v1/chat/completions",
            json=chat,
            headers={"Authorization": f"Bearer {CLIENT_KEY}", "x-sim-fault": "status:500"},
        ) as r:
            assert r.status in (200, 500)


@pytest.mark.parametrize("fmt", ["text", "json"])
async def test_keys_never_reach_a_log_line(sim: procs.Service, tmp_path: Path, fmt: str) -> None:
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(
        f"auth:\n  api_keys:\n    - name: team\n      sha256: {digest(CLIENT_KEY)}\n"
        f"upstreams:\n  - name: sim\n    url: {sim.url}/v1\n    api_key_env: SIM_KEY\n"
    )
    g = procs.gateway(
        "--config",
        str(cfg),
        "--log-level",
        "debug",
        "--log-format",
        fmt,
        "--access-log",
        env={"SIM_KEY": UPSTREAM_KEY},
    )
    with g:
        await _drive(g)
    out = g.output()
    assert "tokenpipe.access" in out  # the lines exist and were checked
    for key in (CLIENT_KEY, WRONG_KEY, UPSTREAM_KEY):
        assert key not in out
    assert not CREDENTIAL.findall(out)
    assert CLIENT_KEY not in cfg.read_text()  # the config holds only the digest


def test_redaction_masks_keys_whatever_wrote_them() -> None:
    from tokenpipe.observe.logs import redact

    line = (
        f"upstream said: Authorization: Bearer {UPSTREAM_KEY}; api_key={CLIENT_KEY} {UPSTREAM_KEY}"
    )
    out = redact(line)
    assert UPSTREAM_KEY not in out and CLIENT_KEY not in out
    assert out.count("[redacted]") == 3


def test_no_log_file_of_this_test_run_holds_a_key() -> None:
    """Every child process's log saved since this pytest run started (gateways, sims, local
    engines of all test modules that ran before this one)."""
    started = psutil.Process().create_time() - 1
    files = [p for p in Path(LOG_DIR).glob("*.log") if p.stat().st_mtime >= started]
    assert files, f"no process logs in {LOG_DIR} from this run"
    lines = 0
    for p in files:
        for line in p.read_text(errors="replace").splitlines():
            lines += 1
            for key in (CLIENT_KEY, WRONG_KEY, UPSTREAM_KEY):
                assert key not in line, (p.name, line)
            assert not CREDENTIAL.search(line), (p.name, line)
    assert lines > 0
    print(
        f"{len(files)} process logs, {lines} lines, no key ({time.time() - started:.0f} s of run)"
    )


@pytest.mark.parametrize("command", ["bench", "doctor"])
def test_a_report_never_holds_the_key_it_was_run_with(
    sim: procs.Service, tmp_path: Path, command: str
) -> None:
    # The reports' `command` line quoted argv whole: `--api-key` and an Authorization header
    # were written into the JSON and the HTML.
    out_json, out_html = tmp_path / "r.json", tmp_path / "r.html"
    key, other = "sk-report-1f2e3d4c", "sk-report-9a8b7c6d"
    quick = ["--requests", "1"] + (["--sweep", "", "--streams", "0"] if command == "doctor" else [])
    secrets_given = ["--api-key", key, "--header", f"Authorization: Bearer {other}"]
    outputs = ["--header", "x-a:1", "--json", str(out_json), "--html", str(out_html)]
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "tokenpipe",
            command,
            sim.url + "/v1",
            *quick,
            *secrets_given,
            *outputs,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    for path in (out_json, out_html):
        text = path.read_text()
        assert "--api-key" in text and "x-a:1" in text  # the command is there, masked
        assert key not in text and other not in text


def test_the_quick_test_before_the_pattern_never_lets_a_key_through() -> None:
    """redact() runs the pattern only on texts that hold "key", "bearer" or "k-" case-folded:
    it gives what the pattern alone gives, for the cases IGNORECASE folds specially."""
    from tokenpipe.observe.logs import _SECRETS, redact

    texts = [
        f"Authorization: BEARER {CLIENT_KEY}",
        f"x-API-KEY: {CLIENT_KEY}",
        f"api_key={CLIENT_KEY}",
        f"Api-Key: {CLIENT_KEY}",
        f"\u212aey: nothing; api\u212aey={CLIENT_KEY}",  # Kelvin sign: K
        f"\u017fk-{UPSTREAM_KEY[3:]}",  # long s: sk-
        f"RK-{UPSTREAM_KEY[3:]} Pk-{UPSTREAM_KEY[3:]}",
        "POST /v1/chat/completions 200 1.2 ms",
        "",
    ]
    for text in texts:
        assert redact(text) == _SECRETS.sub(lambda m: (m.group(1) or "") + "[redacted]", text)
    assert redact(texts[-2]) is texts[-2]  # nothing to mask: the pattern did not run
    assert "[redacted]" in redact(texts[4]) and "[redacted]" in redact(texts[5])
