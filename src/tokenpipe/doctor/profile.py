"""`doctor --profile PID`: a py-spy flame graph of a running tokenpipe process while the doctor
sends it traffic. py-spy samples the process from outside (no code change, no restart)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path


class ProfilerUnavailable(RuntimeError):
    pass


def py_spy_path() -> str:
    exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(exe).exists():
        raise ProfilerUnavailable(
            "py-spy is not installed: pip install py-spy (or pip install 'tokenpipe[bench]')"
        )
    return exe


class FlameGraph:
    """Runs `py-spy record` for `seconds` against `pid`; `wait()` returns the SVG path."""

    def __init__(self, pid: int, out: str | Path, seconds: float, rate_hz: int = 200) -> None:
        self.out = Path(out)
        self.proc = subprocess.Popen(
            [
                py_spy_path(),
                "record",
                "--pid",
                str(pid),
                "--duration",
                str(max(1, round(seconds))),
                "--rate",
                str(rate_hz),
                "--format",
                "flamegraph",
                "--output",
                str(self.out),
                "--nonblocking",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )

    def wait(self, timeout_s: float) -> Path:
        try:
            out, _ = self.proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate()
        if self.proc.returncode != 0 or not self.out.exists():
            text = out.decode(errors="replace").strip()[-500:]
            raise ProfilerUnavailable(f"py-spy failed (exit {self.proc.returncode}): {text}")
        return self.out
