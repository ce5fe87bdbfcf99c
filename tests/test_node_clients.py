"""The JavaScript clients users point at the gateway, run by Node (tests/node/clients.mjs): the
Vercel AI SDK's default provider `openai(model)`, which streams /v1/responses, and the
Anthropic SDK's `messages.stream` on /v1/messages. Through `make run`'s gateway (the embedded
model: both translated to chat), and through one over the sim (both native: the sim serves
the Responses API, found by `responses: auto`, and Anthropic's Messages API).

Skipped where Node or the packages are absent: `make test` runs `npm ci` in tests/node when
`npm` exists.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import procs
from tokenpipe.engines.local.model import installed

NODE_DIR = Path(__file__).parent / "node"
PACKAGES = ("ai", "@ai-sdk/openai", "@anthropic-ai/sdk")
#: The oldest Node the pinned packages run on (tests/node/package.json `engines`).
NODE_MAJOR = 20
#: Both clients' whole run (seconds): Node starts in ~0.3 s, the embedded model answers 16
#: tokens in ~1 s on 2 cores.
RUN_TIMEOUT = 120.0


def _node_missing() -> str | None:
    """Why the Node clients cannot run here, or None."""
    node = shutil.which("node")
    if node is None:
        return "node is not installed (the JavaScript client tests need Node 20+)"
    version = subprocess.run([node, "--version"], capture_output=True, text=True, check=False)
    major = version.stdout.strip().lstrip("v").split(".")[0]
    if not major.isdigit() or int(major) < NODE_MAJOR:
        return f"node {version.stdout.strip()} is older than {NODE_MAJOR}"
    modules = NODE_DIR / "node_modules"
    # npm writes its hidden lockfile once an install completed: a partial one has none.
    if not (modules / ".package-lock.json").exists() or not all(
        (modules / p / "package.json").exists() for p in PACKAGES
    ):
        return "tests/node/node_modules is missing: run `npm ci` in tests/node (or `make test`)"
    return None


_MISSING = _node_missing()
pytestmark = pytest.mark.skipif(_MISSING is not None, reason=str(_MISSING))


@pytest.fixture(scope="module")
def make_run() -> Iterator[procs.Service]:
    """The gateway as `make run` starts it (`tokenpipe serve`, no upstream), on free ports."""
    if not installed():
        pytest.skip("the `local` extra is not installed")
    # No shutdown grace (as tests/procs.gateway): the module ends 5 s sooner.
    args = ("serve", "--port", "0", "--grpc-port", "0", "--drain-grace-seconds", "0")
    with procs.Service(*args, name="make-run-node", timeout=120) as gw:
        yield gw


@pytest.fixture(scope="module")
def sim_gateway(sim: procs.Service) -> Iterator[procs.Service]:
    """The sim as both an OpenAI and an Anthropic upstream: each client's API natively."""
    base = sim.url + "/v1"
    with procs.gateway("--upstream", base, "--upstream", "anthropic+" + base) as gw:
        yield gw


def _run_clients(gw: procs.Service, model: str) -> dict[str, dict[str, Any]]:
    """What each client got, by client name."""
    done = subprocess.run(
        ["node", "clients.mjs", gw.url, model],
        cwd=NODE_DIR,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    got = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return {g["client"]: g for g in got}


def _check(got: dict[str, dict[str, Any]], finishes: dict[str, set[str]]) -> None:
    assert set(got) == {"ai-sdk", "anthropic"}, got
    for name, want in finishes.items():
        g = got[name]
        assert g["error"] is None, g
        assert g["deltas"] > 1 and g["text"].strip(), g  # streamed, not one whole answer
        assert g["finish"] in want, g


#: Each client's finish, in its own words: 16 tokens asked for, the answer may end first.
FINISHES = {"ai-sdk": {"length", "stop"}, "anthropic": {"max_tokens", "end_turn"}}


@pytest.mark.local
def test_the_ai_sdk_and_the_anthropic_sdk_stream_through_make_runs_gateway(
    make_run: procs.Service,
) -> None:
    got = _run_clients(make_run, "gemma-3-270m")
    _check(got, FINISHES)
    # A delta carries one token or more (merged for a slow reader, or a character's bytes).
    assert got["ai-sdk"]["deltas"] <= got["ai-sdk"]["usage"]["outputTokens"] <= 16
    assert got["anthropic"]["deltas"] <= got["anthropic"]["usage"]["output_tokens"] <= 16


def test_the_ai_sdk_and_the_anthropic_sdk_stream_natively_through_the_gateway(
    sim: procs.Service, sim_gateway: procs.Service
) -> None:
    """The sim answers 16 words, one a token, with the usage it counted: each SDK's own
    parsing must find them (the Responses and Messages events passed through unchanged)."""
    got = _run_clients(sim_gateway, "sim-model")
    with urllib.request.urlopen(sim.url + "/sim/stats?last=2", timeout=10) as r:
        kinds = [rec["kind"] for rec in json.load(r)["records"]]
    assert kinds == ["responses", "messages"]  # natively, not translated to chat
    _check(got, {"ai-sdk": {"length"}, "anthropic": {"max_tokens"}})
    assert got["ai-sdk"]["usage"]["outputTokens"] == 16
    assert got["anthropic"]["usage"]["output_tokens"] == 16
    # One word a token; fewer deltas than words when a busy machine slows the reader
    # (deltas merge), never fewer words.
    assert len(got["ai-sdk"]["text"].split()) == 16
    assert got["ai-sdk"]["text"] == got["anthropic"]["text"]  # the sim's seeded words
