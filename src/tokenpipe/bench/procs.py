"""Child processes for tests and benchmarks: start a command on a free port, wait until it
listens (it prints `... listening on http://HOST:PORT`), stop it with SIGTERM."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

_LISTEN = re.compile(rb"listening on (http://[\d.]+:(\d+))")
LOG_DIR = Path(os.environ.get("TOKENPIPE_PROC_LOGS", ".cache/proc-logs"))


class Service:
    """A `tokenpipe ARGS...` child process (or any `argv` that prints the listening line).
    Its output is kept (the last 5,000 lines) and saved to LOG_DIR when it stops."""

    def __init__(
        self,
        *args: str,
        argv: list[str] | None = None,
        env: dict[str, str] | None = None,
        timeout: float = 60.0,
        name: str | None = None,
    ) -> None:
        self.args = argv or [sys.executable, "-m", "tokenpipe", *args]
        self.name = name or (args[0] if args else "proc")
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc = subprocess.Popen(
            self.args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=full_env
        )
        self.lines: deque[bytes] = deque(maxlen=5000)
        self.url = ""
        self.port = 0
        ready = threading.Event()

        def pump() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                self.lines.append(line)
                if not ready.is_set():
                    m = _LISTEN.search(line)
                    if m:
                        self.url = m.group(1).decode()
                        self.port = int(m.group(2))
                        ready.set()
            ready.set()

        self._thread = threading.Thread(target=pump, daemon=True)
        self._thread.start()
        if not ready.wait(timeout) or not self.url:
            self.stop()
            raise RuntimeError(f"{self.name} did not start:\n{self.output()}")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def output(self) -> str:
        return b"".join(self.lines).decode(errors="replace")

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._thread.join(2)
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        (LOG_DIR / f"{self.name}-{self.proc.pid}-{int(time.time())}.log").write_text(self.output())

    def __enter__(self) -> Service:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def sim(*args: str, env: dict[str, str] | None = None) -> Service:
    return Service("sim", "--port", "0", *args, name="sim", env=env)


def gateway(*args: str, env: dict[str, str] | None = None) -> Service:
    # No shutdown grace (docs/config.md `drain_grace_seconds`): these gateways stop as soon as
    # their requests end; a test of the grace passes its own --drain-grace-seconds after these.
    return Service(
        "serve",
        "--port",
        "0",
        "--grpc-port",
        "0",
        "--drain-grace-seconds",
        "0",
        *args,
        name="gateway",
        env=env,
    )
