"""`pip install .` works outside the repo: a wheel built from the tree, installed into a fresh
venv (dependencies come from the dev venv's site-packages via a .pth file, so nothing is
downloaded), runs `tokenpipe --help`, the sim and the gateway, package data included."""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests import procs

ROOT = Path(__file__).parent.parent


def _run(*argv: str | Path, cwd: Path, timeout: float = 300) -> str:
    out = subprocess.run(
        [str(a) for a in argv], cwd=cwd, capture_output=True, text=True, timeout=timeout
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_wheel_installs_into_a_fresh_venv_and_runs_outside_the_repo(tmp_path: Path) -> None:
    # The build runs without isolation (no download of a build backend): it needs the dev
    # venv's own setuptools, which Python 3.11's venv module always installs.
    pytest.importorskip("setuptools")
    dist = tmp_path / "dist"
    _run(
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "-q",
        "-w",
        dist,
        ROOT,
        cwd=tmp_path,
    )
    wheels = list(dist.glob("tokenpipe-*.whl"))
    assert len(wheels) == 1, wheels
    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", venv, cwd=tmp_path)
    py = venv / "bin" / "python"
    # Dependencies: the dev venv's site-packages, appended after the new venv's own (so the
    # wheel's tokenpipe wins over the editable one, whose finder .pth is not run from there).
    new_site = Path(
        _run(
            py, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))", cwd=tmp_path
        ).strip()
    )
    (new_site / "_dev_deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    _run(py, "-m", "pip", "install", "-q", "--no-deps", "--no-index", wheels[0], cwd=tmp_path)

    where = _run(py, "-c", "import tokenpipe; print(tokenpipe.__file__)", cwd=tmp_path)
    assert where.startswith(str(venv)), where
    assert "Usage: tokenpipe" in _run(venv / "bin" / "tokenpipe", "--help", cwd=tmp_path)
    assert "check" in _run(venv / "bin" / "tokenpipe", "config", "--help", cwd=tmp_path)

    exe = str(venv / "bin" / "tokenpipe")
    env = {"PATH": f"{venv / 'bin'}:{os.environ.get('PATH', '')}"}
    with (
        procs.Service(argv=[exe, "sim", "--port", "0"], name="sim-wheel", env=env) as sim,
        procs.Service(
            argv=[exe, "serve", "--port", "0", "--grpc-port", "0", "--upstream", sim.url],
            name="gateway-wheel",
            env=env,
        ) as g,
    ):
        body = json.dumps(
            {
                "model": "sim-model",
                "max_tokens": 3,
                "messages": [{"role": "user", "content": "hi"}],
            }
        ).encode()
        req = urllib.request.Request(
            g.url + "/v1/chat/completions",
            data=body,
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=30) as r:
            answer = json.loads(r.read())
        assert answer["choices"][0]["message"]["content"]
        # Package data made it into the wheel: the OpenAPI description and the proto.
        with urllib.request.urlopen(g.url + "/openapi.json", timeout=30) as r:
            assert json.loads(r.read())["openapi"].startswith("3.1")
