"""The HTML reports of bench and doctor, rendered in headless Chromium: they render, with their
plots, without a console error. Real runs against the sim and (marked `local`) the local model.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import procs

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="chromium is not installed (make setup installs it)"
)
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--enable-logging=stderr",
    "--v=0",
]


def render(page: Path, png: Path, size: str = "1400,1600") -> tuple[str, str]:
    """(DOM after scripts ran, console lines) and a screenshot at `png`, both laid out in a
    window of `size` (so boxes read from the DOM are where the screenshot has them)."""
    url = page.resolve().as_uri()
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as profile:
        dom = subprocess.run(
            [
                CHROMIUM,
                *FLAGS,
                f"--user-data-dir={profile}",
                f"--window-size={size}",
                "--dump-dom",
                url,
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as profile:
        shot = subprocess.run(
            [
                CHROMIUM,
                *FLAGS,
                f"--user-data-dir={profile}",
                f"--window-size={size}",
                f"--screenshot={png}",
                url,
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
    console = "\n".join(
        line for line in (dom.stderr + shot.stderr).splitlines() if ":CONSOLE" in line
    )
    return dom.stdout, console


def assert_rendered(page: Path, png: Path, plots: int) -> None:
    dom, console = render(page, png)
    assert console == "", console
    m = re.search(r'data-plots="(\d+)"', dom)
    assert m and int(m.group(1)) == plots, dom[:500]
    assert "no data" not in dom
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 30_000  # a page of plots, not a blank screenshot (~5 KB)


def _run(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    p = subprocess.run(
        [sys.executable, "-m", "tokenpipe", *args], capture_output=True, text=True, timeout=timeout
    )
    assert p.returncode == 0, p.stdout + p.stderr
    return p


@pytest.fixture(scope="module")
def out_dir() -> Path:
    d = Path(__file__).parent.parent / ".cache" / "test-reports"
    d.mkdir(parents=True, exist_ok=True)
    return d


def test_bench_html_report_from_a_sim_run_renders_with_all_plots(sim, out_dir: Path):
    page = out_dir / "bench-sim.html"
    _run(
        "bench",
        sim.url + "/v1",
        "--concurrency",
        "1,4",
        "--requests",
        "8",
        "--max-tokens",
        "20",
        "--no-progress",
        "--html",
        str(page),
    )
    assert_rendered(page, out_dir / "bench-sim.png", plots=5)


def test_doctor_html_report_from_a_sim_run_renders_with_all_plots(sim, out_dir: Path):
    page = out_dir / "doctor-sim.html"
    _run(
        "doctor",
        sim.url + "/v1",
        "--requests",
        "2",
        "--sweep",
        "8,16,32",
        "--sweep-repeats",
        "1",
        "--streams",
        "3",
        "--html",
        str(page),
    )
    assert_rendered(page, out_dir / "doctor-sim.png", plots=3)


@pytest.fixture(scope="module")
def local() -> Iterator[procs.Service]:
    pytest.importorskip("llama_cpp", reason="the local model needs the `local` extra")
    with procs.Service("local", "--port", "0", timeout=180) as s:
        yield s


@pytest.mark.local
def test_real_run_against_the_local_model_reports_server_phases_and_renders(local, out_dir):
    bench_page, doctor_page = out_dir / "bench-local.html", out_dir / "doctor-local.html"
    doc_json = out_dir / "doctor-local.json"
    # Small on purpose: 2 cores decode one request at a time (a few seconds each when busy).
    _run(
        "bench",
        local.url + "/v1",
        "--model",
        "gemma-3-270m",
        "--concurrency",
        "2",
        "--requests",
        "2",
        "--warmup",
        "0",
        "--max-tokens",
        "8",
        "--no-progress",
        "--html",
        str(bench_page),
    )
    _run(
        "doctor",
        local.url + "/v1",
        "--model",
        "gemma-3-270m",
        "--requests",
        "1",
        "--max-tokens",
        "8",
        "--sweep",
        "",
        "--streams",
        "2",
        "--json",
        str(doc_json),
        "--html",
        str(doctor_page),
    )
    phases = json.loads(doc_json.read_text())["phases_ms"]
    # The local engine reports its own queue/prefill/decode in the SSE comment.
    assert {"server_prefill", "server_decode"} <= set(phases)
    assert_rendered(bench_page, out_dir / "bench-local.png", plots=5)
    assert_rendered(doctor_page, out_dir / "doctor-local.png", plots=2)
