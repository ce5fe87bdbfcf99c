"""wrk (a C load generator) as the client of a benchmark: its own CPU is small and steady, so
the server measured has a core to itself, which a Python load generator on these 2 cores
does not leave it. Debian: `apt-get install wrk`."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from _common import ROOT

_PROMPT = ("hello " * 24).strip()
#: wrk's request: a 1-token streamed chat request for the sim's model, ~32 prompt tokens.
SCRIPT = f"""wrk.method = "POST"
wrk.body = '{{"model":"sim-model","messages":[{{"role":"user","content":"{_PROMPT}"}}],\\
"max_tokens":1,"stream":true}}'
wrk.headers["Content-Type"] = "application/json"
"""


def available() -> bool:
    return any(os.access(Path(d) / "wrk", os.X_OK) for d in os.environ["PATH"].split(os.pathsep))


def script() -> Path:
    """SCRIPT in a file under .cache/ (wrk reads its Lua from a file)."""
    path = ROOT / ".cache" / "wrk-chat.lua"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(SCRIPT)
    return path


def run(url: str, seconds: float, connections: int) -> tuple[int, int]:
    """(requests answered, non-2xx answers) of one wrk run of SCRIPT against `url`, one wrk
    thread holding `connections` keep-alive connections for `seconds`."""
    argv = ["wrk", "-t1", f"-c{connections}", f"-d{seconds:g}s", "-s", str(script()), url]
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    done = re.search(r"(\d+) requests in", out)
    if done is None:
        raise RuntimeError(f"wrk printed no request count:\n{out}")
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    return int(done.group(1)), int(bad.group(1)) if bad else 0
