"""Every run is visible in the bench and doctor HTML reports: the screenshots headless Chromium
takes show each run's colour inside each histogram and a timeline panel per run with its
decoding bars, the doctor's probe plot has a row per stream, and through a gateway the
doctor's waterfall draws the gateway's own phases (Server-Timing) where and as long as they
ran. Real runs against the sim.
"""

from __future__ import annotations

import html
import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import png, procs
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


#: The doctor's colours of the gateway's queue and of the upstream's first token
#: (tokenpipe.doctor.inside).
GATEWAY_QUEUE, UPSTREAM_FIRST = "#db2777", "#854d0e"
_RECT = re.compile(
    r'<rect x="([\d.]+)" y="[\d.]+" width="([\d.]+)" height="[\d.]+" fill="[^"]+" '
    r'data-row="([^"]+)"'
)


@pytest.fixture(scope="module")
def queued(tmp_path_factory: pytest.TempPathFactory) -> Iterator[procs.Service]:
    """A gateway letting one request a second through to a sim with a 300 ms TTFT: every
    traced request after the first waits in the gateway's queue, then for the sim."""
    with procs.sim("--ttft-ms", "300", "--itl-ms", "2", "--output-tokens", "20") as sim:
        cfg = tmp_path_factory.mktemp("queued") / "gw.yaml"
        cfg.write_text(
            f"upstreams:\n  - {{name: sim, url: '{sim.url}/v1'}}\n"
            "limits:\n  upstreams:\n    sim: {rpm: 60, bucket_seconds: 1}\n"
        )
        with procs.gateway("--config", str(cfg)) as g:
            yield g


def test_doctor_draws_the_gateways_phases_inside_its_waterfall(
    queued: procs.Service, out_dir: Path
) -> None:
    page, doc = out_dir / "doctor-gateway.html", out_dir / "doctor-gateway.json"
    _run(
        "doctor",
        queued.url + "/v1",
        "--requests",
        "3",
        "--sweep",
        "",
        "--streams",
        "0",
        "--max-tokens",
        "20",
        "--html",
        str(page),
        "--json",
        str(doc),
    )
    ph = json.loads(doc.read_text())["phases_ms"]  # the shown (median) request's
    assert ph["server_limiter_wait"] > 300  # it waited for the one request a second
    assert ph["server_upstream_first_token"] == pytest.approx(300, abs=60)  # the sim's TTFT
    dom, boxes, img = _shot(page, out_dir / "doctor-gateway.png")
    waterfall = dom.split('id="plot-waterfall"', 1)[1].split("</svg>", 1)[0]
    rects = {row: (float(x), float(w)) for x, w, row in _RECT.findall(waterfall)}
    rows = ["gateway edge", "gateway admission", "gateway context", "gateway queue"]
    for row in [*rows, "upstream headers", "upstream first token"]:
        assert row in rects, sorted(rects)
        assert f">{row} " in waterfall  # labelled with its ms
    # One scale for the client's phases and the gateway's: widths are proportional to ms.
    px = rects["headers"][1] / ph["headers"]
    queue_x, queue_w = rects["gateway queue"]
    first_x, first_w = rects["upstream first token"]
    assert queue_w == pytest.approx(ph["server_limiter_wait"] * px, rel=0.03, abs=1)
    assert first_w == pytest.approx(ph["server_upstream_first_token"] * px, rel=0.03, abs=1)
    # Placed where they ran: the queue inside the client's wait for headers (the gateway's
    # phases before it take well under a pixel), the upstream's first token after it, where
    # the client's own first_token phase starts, up to 20 ms after it: the answer's head on
    # its way to the client (its write, the client's wake-up: 6-11 ms on a loaded VM, where
    # 3 px failed 2 runs in 3 on this tree and its parent alike). A phase drawn out of
    # place is off by the 300-ms queue or more.
    assert queue_x == pytest.approx(rects["headers"][0], abs=2)
    client_first = rects["first_token"][0]
    assert client_first - max(3, 20 * px) <= first_x <= client_first + 3
    # On screen, in their colours and proportions.
    x, y, w, h = boxes["plot-waterfall"]
    area = (x + PAD_L, y + PAD_T, w - PAD_L, h - PAD_T - PAD_B)
    queue_px = img.count(GATEWAY_QUEUE, area, tolerance=8)
    first_px = img.count(UPSTREAM_FIRST, area, tolerance=8)
    assert queue_px >= 300 and first_px >= 150, (queue_px, first_px)
    assert queue_px / first_px == pytest.approx(queue_w / first_w, rel=0.15)
    assert len((out_dir / "doctor-gateway.png").read_bytes()) > 30_000
    # The summary and the findings name the gateway's biggest phase.
    text = html.unescape(dom)
    assert "inside the gateway, queue (" in text
    assert "gateway queue" in text and "(largest: queue" in text
