"""CPU per request of the front's HTTP/1.1 server against the well-kept servers it could have
been: aiohttp's web server, Granian (Rust, RSGI) and uvicorn's httptools protocol (ASGI).
Each serves the same tiny SSE answer (`_front_apps.py`: the body read, a role chunk, one
content chunk, `[DONE]`) to the same wrk load, rounds interleaved; the table gives the
server's CPU (every process and thread of it) per request.

    python benchmarks/front_servers.py                      # ~2 min; needs wrk on PATH
    python benchmarks/front_servers.py --rounds 7 --seconds 8 --concurrency 32

Granian and uvicorn are installed (with their own uvloop and httptools) into
.cache/front-servers-venv on first use, so their pins never touch the project's venv. Each
runs one worker on uvloop, HTTP/1.1 only, without access logs; Granian with one runtime
thread (its default). wrk is a C client: its own CPU does not crowd the server as a Python
load generator's would. JSON in results/front_servers.json.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import _wrk
from _common import ROOT, free_port, stop, wait_listening, write_json

VENV = ROOT / ".cache" / "front-servers-venv"
PEERS = ("granian", "uvicorn", "uvloop", "httptools")
HERE = ROOT / "benchmarks"
#: wrk's request: a 1-token streamed chat request, as the gateway's benchmarks send.


def _peer_venv() -> Path:
    """The venv holding Granian and uvicorn (made on first use)."""
    py = VENV / "bin" / "python"
    if not py.exists():
        print("installing granian and uvicorn into .cache/front-servers-venv (one-off) ...")
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", *PEERS], check=True)
    return py


def _versions(py: Path) -> dict[str, str]:
    code = "import importlib.metadata as m, sys; print(*(m.version(p) for p in sys.argv[1:]))"
    out = subprocess.run([str(py), "-c", code, *PEERS], capture_output=True, text=True)
    return dict(zip(PEERS, out.stdout.split(), strict=False))


def _argv(name: str, port: int, peer_py: Path) -> list[str]:
    if name in ("tokenpipe", "aiohttp"):
        return [sys.executable, str(HERE / "_front_apps.py"), name, str(port)]
    bindir = peer_py.parent
    if name == "granian":
        return [
            str(bindir / "granian"), "--interface", "rsgi", "--workers", "1",
            "--runtime-mode", "st", "--loop", "uvloop", "--http", "1", "--no-ws",
            "--log-level", "error", "--no-access-log", "--port", str(port),
            "_front_apps:rsgi_app",
        ]  # fmt: skip
    return [
        str(bindir / "uvicorn"), "--http", "httptools", "--loop", "uvloop", "--lifespan", "off",
        "--no-access-log", "--log-level", "error", "--port", str(port), "_front_apps:asgi_app",
    ]  # fmt: skip


def _url(port: int) -> str:
    return f"http://127.0.0.1:{port}/v1/chat/completions"


@contextlib.contextmanager
def _servers(names: list[str], peer_py: Path | None) -> Iterator[dict[str, tuple[int, int]]]:
    """name -> (pid, port) of each server, running while the block runs."""
    procs: dict[str, tuple[subprocess.Popen[bytes], int]] = {}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT / "src")])}
    try:
        for name in names:
            port = free_port()
            argv = _argv(name, port, peer_py or Path(sys.executable))
            procs[name] = (subprocess.Popen(argv, cwd=HERE, env=env), port)
        for p, port in procs.values():
            wait_listening(port, 30, p)
        yield {name: (p.pid, port) for name, (p, port) in procs.items()}
    finally:
        for p, _ in procs.values():
            stop(p)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seconds", type=float, default=5.0, help="wrk's run per server per round")
    p.add_argument("--concurrency", type=int, default=8, help="wrk's connections")
    p.add_argument("--servers", default="tokenpipe,aiohttp,granian,uvicorn")
    p.add_argument("--json", default=str(ROOT / "results" / "front_servers.json"))
    args = p.parse_args()
    if not _wrk.available():
        p.error("needs wrk on PATH (Debian: apt-get install wrk)")
    names = [n.strip() for n in args.servers.split(",") if n.strip()]
    unknown = set(names) - {"tokenpipe", "aiohttp", "granian", "uvicorn"}
    if unknown:
        p.error(f"unknown servers: {', '.join(sorted(unknown))}")
    peer_py = _peer_venv() if {"granian", "uvicorn"} & set(names) else None
    versions = _versions(peer_py) if peer_py else {}
    us: dict[str, list[float]] = {n: [] for n in names}
    rps: dict[str, list[float]] = {n: [] for n in names}
    errors = dict.fromkeys(names, 0)
    with _servers(names, peer_py) as running:
        for _pid, port in running.values():  # warm-up, uncounted
            _wrk.run(_url(port), 2, args.concurrency)
        for r in range(args.rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                pid, port = running[name]
                cost, rate, bad = _wrk.measure(pid, _url(port), args.seconds, args.concurrency)
                us[name].append(cost)
                rps[name].append(rate)
                errors[name] += bad
            print(f"  round {r + 1}/{args.rounds}", flush=True)
    print()
    labels = {n: f"{n} {versions[n]}" for n in names if n in versions}
    rows = _wrk.table(us, rps, names[0], labels)
    for row in rows:
        row["version"] = versions.get(row["target"])
        row["non_2xx"] = errors[row["target"]]
    if any(errors.values()):
        print("non-2xx answers: " + ", ".join(f"{n} {e}" for n, e in errors.items() if e))
    write_json(args.json, "front_servers", args, servers=rows)


if __name__ == "__main__":
    main()
