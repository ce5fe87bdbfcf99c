"""The doctor against the sim with injected faults: it names what was injected, and only that."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import procs
from tokenpipe.bench import ChatRequest
from tokenpipe.doctor import KINDS, DoctorOptions, Thresholds, check_scaling, diagnose
from tokenpipe.doctor.hol import find_shared_stalls, probe
from tokenpipe.doctor.trace import PHASES


@pytest.fixture(scope="module")
def paced() -> Iterator[procs.Service]:
    with procs.sim("--ttft-ms", "50", "--itl-ms", "5", "--output-tokens", "40") as s:
        yield s


def _opts(url: str, **kw: object) -> DoctorOptions:
    base: dict[str, object] = {"requests": 2, "max_tokens": 40, "sweep": [], "hol_streams": 0}
    base.update(kw)
    return DoctorOptions(url + "/v1", **base)  # type: ignore[arg-type]


def _kinds(report) -> set[str]:
    return {f.kind for f in report.findings}


async def test_healthy_stream_gets_a_waterfall_that_adds_up_and_no_findings(paced):
    r = await diagnose(_opts(paced.url))
    assert _kinds(r) == set()
    ph = r.phases_ms
    assert set(PHASES) <= set(ph)
    rec = r.traced[r.shown].record  # type: ignore[index]
    assert sum(ph[k] for k in PHASES) == pytest.approx(rec.e2e * 1000, abs=0.5)  # type: ignore
    assert ph["connect"] > 0  # a fresh connection per traced request
    # 50 ms to the first token after the headers, 39 gaps of 5 ms while decoding.
    assert ph["first_token"] == pytest.approx(50, abs=5)
    assert ph["decode"] == pytest.approx(195, rel=0.05)


async def test_injected_stall_is_named_with_its_size_and_position(paced):
    r = await diagnose(_opts(paced.url, headers={"x-sim-fault": "stall:10:400"}))
    stalls = [f for f in r.findings if f.kind == "stall"]
    assert len(stalls) == 2  # one per traced request
    assert "after about token 10" in stalls[0].evidence
    assert "no token for 4" in stalls[0].evidence  # ~400 ms
    assert "slow_first_token" not in _kinds(r)


async def test_injected_slow_first_token_is_named(paced):
    r = await diagnose(_opts(paced.url, headers={"x-sim-fault": "stall-first:1200"}))
    assert "slow_first_token" in _kinds(r)
    assert "stall" not in _kinds(r)


async def test_multi_token_chunks_are_named_chunking(paced):
    r = await diagnose(_opts(paced.url, headers={"x-sim-tokens-per-chunk": "4"}))
    [f] = [f for f in r.findings if f.kind == "chunking"]
    assert "4.0 tokens per chunk" in f.evidence


async def test_stall_that_hits_all_shared_streams_at_once_is_hol_blocking(paced):
    url = paced.url + "/v1"
    stalled = [
        ChatRequest(
            "m", [{"role": "user", "content": "hi"}], 40, headers={"x-sim-fault": "stall:10:400"}
        )
        for _ in range(4)
    ]
    p = await probe(url, stalled)
    assert len(p.records) == 4 and all(r.ok for r in p.records)
    [f] = find_shared_stalls(p, Thresholds())
    assert f.kind == "hol_blocking"
    assert "4 of 4" in f.evidence
    # One stalled stream among healthy ones is a stall, not head-of-line blocking.
    one = [
        ChatRequest(
            "m",
            [{"role": "user", "content": "hi"}],
            40,
            headers={"x-sim-fault": "stall:10:400"} if i == 0 else {},
        )
        for i in range(4)
    ]
    assert find_shared_stalls(await probe(url, one), Thresholds()) == []


async def test_output_length_fit_recovers_the_sims_per_token_time(paced):
    r = await diagnose(_opts(paced.url, requests=1, sweep=[10, 20, 40, 80], sweep_repeats=1))
    assert r.scaling is not None
    assert [n for n, _ in r.sweep_points] == [10, 20, 40, 80]
    assert r.scaling.fit.slope == pytest.approx(5.0, rel=0.05)  # ms per token
    assert r.scaling.fit.r2 > 0.99
    assert not r.scaling.superlinear
    assert "superlinear_output_scaling" not in _kinds(r)


def test_superlinear_growth_is_detected_and_a_line_is_not():
    xs = [10.0, 20, 40, 80, 160]
    line = check_scaling(xs, [50 + 5 * x for x in xs])
    assert not line.superlinear and line.fit.slope == pytest.approx(5)
    curve = check_scaling(xs, [50 + 5 * x + 0.05 * x * x for x in xs])
    assert curve.superlinear
    assert "faster than linear" in curve.evidence


def test_cli_writes_json_with_every_phase_and_named_findings(paced, tmp_path: Path):
    out = tmp_path / "doctor.json"
    html = tmp_path / "doctor.html"
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "tokenpipe",
            "doctor",
            paced.url + "/v1",
            "--requests",
            "2",
            "--sweep",
            "8,16,32",
            "--sweep-repeats",
            "1",
            "--streams",
            "3",
            "--header",
            "x-sim-fault:stall:5:300",
            "--json",
            str(out),
            "--html",
            str(html),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    doc = json.loads(out.read_text())
    assert set(PHASES) <= set(doc["phases_ms"])
    kinds = {f["kind"] for f in doc["findings"]}
    assert {"stall", "hol_blocking"} <= kinds <= set(KINDS)
    assert all(f["evidence"] for f in doc["findings"])
    assert doc["output_length"]["r2"] > 0.9
    assert "stall" in p.stdout and "waterfall" in p.stdout
    assert 'id="plot-waterfall"' in html.read_text()


def test_profile_writes_a_flame_graph_of_a_running_process(paced, tmp_path: Path):
    svg = tmp_path / "flame.svg"
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "tokenpipe",
            "doctor",
            paced.url + "/v1",
            "--requests",
            "3",
            "--max-tokens",
            "400",
            "--header",
            "x-sim-itl-ms:0.2",
            "--sweep",
            "",
            "--streams",
            "4",
            "--profile",
            str(paced.pid),
            "--profile-seconds",
            "2",
            "--profile-out",
            str(svg),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    if "py-spy failed" in p.stdout and "ptrace" in p.stdout.lower():
        pytest.skip("this machine does not allow ptrace")
    assert svg.exists(), p.stdout
    text = svg.read_text()
    assert "<svg" in text and "tokenpipe" in text


def _has_grpc_gen() -> bool:
    try:
        import tokenpipe.front.grpc_gen.chat_pb2  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(scope="module")
def grpc_gateway(paced) -> Iterator[str]:
    """The gateway in front of the paced sim, with gRPC on; yields its gRPC host:port."""
    with socket.socket() as sock:  # a free port for gRPC (the gateway's 0 turns gRPC off)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # The later --grpc-port wins over procs.gateway's own "0" (off).
    with procs.gateway("--grpc-port", str(port), "--upstream", paced.url + "/v1") as gw:
        deadline = time.monotonic() + 30
        while "gRPC listening" not in gw.output():
            assert time.monotonic() < deadline, gw.output()
            time.sleep(0.05)  # polling a condition with a deadline
        yield f"127.0.0.1:{port}"


@pytest.mark.skipif(not _has_grpc_gen(), reason="no generated gRPC code yet")
async def test_stall_on_every_stream_of_one_grpc_channel_is_hol_blocking(grpc_gateway):
    # gRPC carries no custom headers: the fault travels as a prompt directive to the sim.
    def req(fault: bool) -> ChatRequest:
        text = "[[sim fault=stall:10:400]] hi" if fault else "hi"
        return ChatRequest("sim-model", [{"role": "user", "content": text}], 40)

    p = await probe("http://unused", [req(True) for _ in range(4)], grpc_url=grpc_gateway)
    assert p.shared_connection and "gRPC" in p.transport
    assert all(r.ok for r in p.records), [r.error for r in p.records]
    [f] = find_shared_stalls(p, Thresholds())
    assert "4 of 4" in f.evidence and "share one connection" in f.evidence
    p = await probe("http://unused", [req(i == 0) for i in range(4)], grpc_url=grpc_gateway)
    assert find_shared_stalls(p, Thresholds()) == []
