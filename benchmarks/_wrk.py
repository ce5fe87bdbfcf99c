"""wrk (a C load generator) as the client of a benchmark: its own CPU is small and steady, so
the server measured has a core to itself, which a Python load generator on these 2 cores
does not leave it. Debian: `apt-get install wrk`."""

from __future__ import annotations

import re
import shutil
import statistics
import subprocess
from pathlib import Path
from typing import Any

from _common import ROOT, cpu_seconds

#: The prompt's bytes by default: 24 words, ~32 prompt tokens.
PROMPT_BYTES = 143


def lua(prompt_bytes: int = PROMPT_BYTES, stream: bool = True) -> str:
    """wrk's request: a 1-token chat request for the sim's model whose one message is
    `prompt_bytes` of words, streamed (or, `stream` False, asking for a whole answer)."""
    prompt = ("hello " * (prompt_bytes // 6 + 1))[:prompt_bytes].strip()
    return f"""wrk.method = "POST"
wrk.body = '{{"model":"sim-model","messages":[{{"role":"user","content":"{prompt}"}}],\\
"max_tokens":1,"stream":{"true" if stream else "false"}}}'
wrk.headers["Content-Type"] = "application/json"
"""


def available() -> bool:
    return shutil.which("wrk") is not None


def script(prompt_bytes: int = PROMPT_BYTES, stream: bool = True) -> Path:
    """`lua(prompt_bytes, stream)` in a file under .cache/ (wrk reads its Lua from a file)."""
    path = ROOT / ".cache" / f"wrk-chat-{prompt_bytes}{'' if stream else '-whole'}.lua"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(lua(prompt_bytes, stream))
    return path


def run(
    url: str,
    seconds: float,
    connections: int,
    prompt_bytes: int = PROMPT_BYTES,
    stream: bool = True,
) -> tuple[int, int]:
    """(requests answered, non-2xx answers) of one wrk run of `lua(prompt_bytes, stream)`
    against `url`, one wrk thread holding `connections` keep-alive connections for
    `seconds`."""
    lua_file = str(script(prompt_bytes, stream))
    argv = ["wrk", "-t1", f"-c{connections}", f"-d{seconds:g}s", "-s", lua_file, url]
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    done = re.search(r"(\d+) requests in", out)
    if done is None:
        raise RuntimeError(f"wrk printed no request count:\n{out}")
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    return int(done.group(1)), int(bad.group(1)) if bad else 0


def measure(
    pid: int,
    url: str,
    seconds: float,
    connections: int,
    prompt_bytes: int = PROMPT_BYTES,
    stream: bool = True,
) -> tuple[float, float, int]:
    """One `run` against the server `pid`: (its CPU microseconds per request, its process
    and children counted; requests/s; non-2xx answers)."""
    before = cpu_seconds(pid)
    n, bad = run(url, seconds, connections, prompt_bytes, stream)
    return (cpu_seconds(pid) - before) / max(n, 1) * 1e6, n / seconds, bad


def table(
    us: dict[str, list[float]],
    rps: dict[str, list[float]],
    reference: str,
    labels: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    """Prints each target's CPU per request (median and the rounds' range), each round's
    ratio to `reference`'s in the same round (so the machine's drift cancels: median and
    range) and requests/s; returns the rows for the JSON."""
    labels = labels or {}
    ref = us[reference]
    print(f"{'target':<22}{'us/request':>11}{'rounds':>10}{'x ' + reference:>18}{'req/s':>8}")
    rows = []
    for name, values in us.items():
        med = statistics.median(values)
        ratios = [a / b for a, b in zip(values, ref, strict=True)]
        spread = f"{min(values):.0f}-{max(values):.0f}"
        ratio = f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"
        rate = statistics.median(rps[name])
        print(f"{labels.get(name, name):<22}{med:>11.1f}{spread:>10}{ratio:>18}{rate:>8.0f}")
        rows.append(
            {
                "target": name,
                "us_per_request": med,
                "rounds_us_per_request": values,
                "x_reference_per_round": ratios,
                "requests_per_s": rate,
            }
        )
    return rows
