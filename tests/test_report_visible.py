"""Every run is visible in the bench and doctor HTML reports: the screenshots headless Chromium
takes show each run's colour inside each histogram and a timeline panel per run with its
decoding bars, and the doctor's probe plot has a row per stream. Real runs against the sim.
"""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

import pytest

from tests import png
from tests.test_bench_html import CHROMIUM, _run, render

pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="chromium is not installed (make setup installs it)"
)
#: The bench's run colours (tokenpipe.bench.svg.COLORS) and the timeline's decoding blue.
RUN_COLORS = ("#2563eb", "#dc2626", "#16a34a")
DECODING = "#2563eb"
#: Plot frame inside an SVG (svg.PAD_*), less the legend's 160 px at the top right.
PAD_L, PAD_T, PAD_B, LEGEND_W = 64, 30, 44, 160
SIZE = "1400,2600"


@pytest.fixture(scope="module")
def out_dir() -> Path:
    d = Path(__file__).parent.parent / ".cache" / "test-reports"
    d.mkdir(parents=True, exist_ok=True)
    return d


def _shot(page: Path, shot: Path) -> tuple[str, dict[str, list[int]], png.Image]:
    dom, console = render(page, shot, SIZE)
    assert console == "", console
    m = re.search(r'data-boxes="([^"]*)"', dom)
    assert m, dom[:500]
    return dom, json.loads(html.unescape(m.group(1))), png.read(shot.read_bytes())


def _inner(box: list[int]) -> tuple[int, int, int, int]:
    """The data area of a plot at `box` (axes, title and legend cut off, and the 8 px above
    the x axis, where an outline's vertical edges start, so a colour counts only from bars)."""
    x, y, w, h = box
    return (x + PAD_L + 2, y + PAD_T + 2, w - PAD_L - LEGEND_W, h - PAD_T - PAD_B - 10)


def test_bench_report_shows_every_run_in_histograms_and_timeline(sim, out_dir: Path):
    page = out_dir / "bench-runs.html"
    _run(
        "bench",
        sim.url + "/v1",
        "--concurrency",
        "1,2,4",
        "--requests",
        "12",
        "--max-tokens",
        "20",
        "--no-progress",
        "--html",
        str(page),
    )
    text = page.read_text()
    assert "no SLO" in text  # goodput without --slo is not passed off as req/s
    dom, boxes, img = _shot(page, out_dir / "bench-runs.png")
    runs = ["c=1", "c=2", "c=4"]
    for plot in ("plot-ttft", "plot-itl"):
        svg = dom.split(f'id="{plot}"', 1)[1].split("</svg>", 1)[0]
        assert re.findall(r'data-series="([^"]+)"', svg) == runs, plot
        for run, color in zip(runs, RUN_COLORS, strict=True):
            seen = img.count(color, _inner(boxes[plot]))
            assert seen >= 30, f"{plot}: run {run} ({color}) has {seen} pixels on screen"
    timeline = dom.split('id="plot-timeline"', 1)[1]
    panels = re.findall(r'<svg [^>]*class="panel" id="(timeline-\d+)"', timeline)
    assert panels == ["timeline-0", "timeline-1", "timeline-2"], panels
    for i, run in enumerate(runs):
        assert f"{run}: 12 of 12 requests" in timeline
        seen = img.count(DECODING, _inner([*boxes[f"timeline-{i}"][:3], 200]), tolerance=8)
        assert seen >= 100, f"timeline of {run}: {seen} decoding pixels on screen"


def test_doctor_report_shows_every_stream_of_the_probe(sim, out_dir: Path):
    page = out_dir / "doctor-runs.html"
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
        "4",
        "--html",
        str(page),
    )
    dom, boxes, img = _shot(page, out_dir / "doctor-runs.png")
    hol = dom.split('id="plot-hol"', 1)[1].split("</svg>", 1)[0]
    assert sorted(set(re.findall(r'data-row="([^"]+)"', hol))) == [f"stream {i}" for i in range(4)]
    x, y, w, h = _inner(boxes["plot-hol"])
    band = h // 4
    for i in range(4):  # row i of 4, top to bottom: each stream's bars are on screen
        seen = img.count(DECODING, (x, y + i * band, w + LEGEND_W - 20, band), tolerance=8)
        assert seen >= 20, f"stream {i}: {seen} decoding pixels on screen"
    waterfall = dom.split('id="plot-waterfall"', 1)[1].split("</svg>", 1)[0]
    assert len(set(re.findall(r'data-row="([^"]+)"', waterfall))) == 8
