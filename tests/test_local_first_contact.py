"""What a new user meets first: `make run` (serve with no upstream, the embedded model) and the
README's first request, with the real model. The request is read out of README.md itself, so
the test breaks when the README drifts."""

from __future__ import annotations

import http.client
import json
import os
import re
import shlex
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from tests import procs
from tokenpipe import sse
from tokenpipe.engines.local.model import installed

pytestmark = [
    pytest.mark.local,
    pytest.mark.skipif(
        not installed() and not os.environ.get("CI"), reason="the `local` extra is not installed"
    ),
]

README = Path(__file__).parent.parent / "README.md"
#: The README's first request must end within this (seconds) on a 2-core machine.
FIRST_REQUEST_LIMIT = 30.0
_CHILD = re.compile(r"local model \(Gemma 3 270M\) at (http://[\d.]+:\d+)/v1")


@pytest.fixture(scope="module")
def make_run() -> Iterator[procs.Service]:
    """The gateway as `make run` starts it (`tokenpipe serve`, no upstream), on free ports."""
    with procs.Service(
        "serve", "--port", "0", "--grpc-port", "0", name="make-run", timeout=120
    ) as gw:
        yield gw


def _child_url(gw: procs.Service) -> str:
    m = _CHILD.search(gw.output())
    assert m, gw.output()
    return m.group(1)


def _curl(text: str) -> tuple[str, dict[str, str], dict[str, Any]]:
    """The URL, headers and JSON body of the first `curl` command in `text`."""
    block = re.search(r"```sh\n(curl .*?)```", text, re.S)
    assert block, "no curl command in a ```sh block"
    argv = shlex.split(block.group(1).replace("\\\n", " "))
    url = next(a for a in argv if a.startswith("http"))
    headers = {}
    for i, a in enumerate(argv):
        if a == "-H":
            name, _, value = argv[i + 1].partition(":")
            headers[name.strip()] = value.strip()
    body = json.loads(argv[argv.index("-d") + 1])
    return url, headers, body


def _post(base: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    req = urllib.request.Request(
        base + path, data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_the_readmes_first_request_ends_within_30_seconds(make_run: procs.Service) -> None:
    url, headers, body = _curl(README.read_text())
    parts = urlsplit(url)
    gw = urlsplit(make_run.url)
    conn = http.client.HTTPConnection(gw.hostname or "", gw.port, timeout=FIRST_REQUEST_LIMIT)
    started = time.monotonic()
    conn.request("POST", parts.path, body=json.dumps(body), headers=headers)
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    decoder = sse.SSEDecoder()
    events: list[sse.Event] = []
    while not any(e.data == sse.DONE for e in events):
        assert time.monotonic() - started < FIRST_REQUEST_LIMIT, "the first request did not end"
        data = resp.read1(65536)
        if not data:
            break
        events += decoder.feed(data)
    elapsed = time.monotonic() - started
    conn.close()
    assert events and events[-1].data == sse.DONE, "the stream did not complete"
    assert elapsed < FIRST_REQUEST_LIMIT
    chunks = [json.loads(e.data) for e in events if not e.comment and e.data != sse.DONE]
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finish[-1] in ("stop", "length")
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text


def test_make_runs_examples_set_a_small_max_tokens(make_run: procs.Service) -> None:
    out = make_run.output()
    body = re.search(r"-d '(\{.*?\})'", out)
    assert body, out
    assert 0 < json.loads(body.group(1))["max_tokens"] <= 64
    assert "max_tokens=64" in out  # the Python one-liner too


@pytest.mark.parametrize(
    ("path", "extra", "param"),
    [
        (
            "/v1/chat/completions",
            {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"},
            "tool_choice",
        ),
        (
            "/v1/chat/completions",
            {
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": {"name": "f"}},
            },
            "tool_choice",
        ),
        ("/v1/chat/completions", {"logprobs": True}, "logprobs"),
        ("/v1/chat/completions", {"top_logprobs": 3}, "top_logprobs"),
        (
            "/v1/chat/completions",
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {}},
                }
            },
            "response_format",
        ),
        ("/v1/completions", {"logprobs": 2}, "logprobs"),
    ],
)
def test_what_the_model_cannot_honour_is_a_400_naming_it_through_the_gateway_unchanged(
    make_run: procs.Service, path: str, extra: dict[str, Any], param: str
) -> None:
    if path == "/v1/completions":
        body: dict[str, Any] = {"model": "gemma-3-270m", "prompt": "Hi", "max_tokens": 2}
    else:
        body = {
            "model": "gemma-3-270m",
            "max_tokens": 2,
            "messages": [{"role": "user", "content": "Hi"}],
        }
    body.update(extra)
    direct_status, direct = _post(_child_url(make_run), path, body)
    status, through = _post(make_run.url, path, body)
    assert direct_status == 400 and direct["error"]["param"] == param, direct
    assert param in direct["error"]["message"]
    assert (status, through) == (direct_status, direct)


def test_what_only_allows_a_behaviour_is_still_served(make_run: procs.Service) -> None:
    """tool_choice "auto", logprobs false and response_format "text" are honoured by text."""
    status, reply = _post(
        make_run.url,
        "/v1/chat/completions",
        {
            "model": "gemma-3-270m",
            "max_tokens": 2,
            "messages": [{"role": "user", "content": "Hi"}],
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": "auto",
            "logprobs": False,
            "response_format": {"type": "text"},
        },
    )
    assert status == 200, reply
    assert reply["usage"]["completion_tokens"] <= 2


def test_llama_cpps_start_up_chatter_does_not_reach_the_terminal(
    make_run: procs.Service,
) -> None:
    # One request first: the gateway loads the model's vocabulary to count prompt tokens.
    status, _ = _post(
        make_run.url,
        "/v1/chat/completions",
        {"model": "gemma-3-270m", "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]},
    )
    assert status == 200
    out = make_run.output()
    for chatter in ("llama_", "n_ctx", "SWA cache", "print_info", "load_tensors"):
        assert chatter not in out, out


def test_a_request_without_max_tokens_stops_at_the_configured_default(tmp_path: Path) -> None:
    """`local.default_max_tokens` (serve's config) reaches the engine's cap; the reply says
    `length` honestly."""
    config = tmp_path / "gw.yaml"
    config.write_text("local:\n  default_max_tokens: 6\n")
    with procs.Service(
        "serve",
        "--config",
        str(config),
        "--port",
        "0",
        "--grpc-port",
        "0",
        name="gateway-capped",
        timeout=120,
    ) as gw:
        status, reply = _post(
            gw.url,
            "/v1/chat/completions",
            {
                "model": "gemma-3-270m",
                "ignore_eos": True,  # the model would otherwise be free to stop early
                "messages": [{"role": "user", "content": "Count to one hundred."}],
            },
        )
    assert status == 200, reply
    assert reply["usage"]["completion_tokens"] == 6
    assert reply["choices"][0]["finish_reason"] == "length"


def test_the_default_cap_is_256_tokens_and_documented_in_local_help() -> None:
    from click.testing import CliRunner

    from tokenpipe.cli import main
    from tokenpipe.settings import Settings

    result = CliRunner().invoke(main, ["local", "--help"])
    assert result.exit_code == 0
    assert "--default-max-tokens" in result.output and "256" in result.output
    assert Settings().local.default_max_tokens == 256


def test_every_metric_docs_local_md_names_is_exposed_by_that_name(make_run: procs.Service) -> None:
    """Names as Prometheus scrapes them: a counter `NAME` is the series `NAME_total`, a
    histogram's base name stands for its `_bucket`, `_sum` and `_count` series. Read from the
    `# TYPE` lines: a labelled counter has no series before its first label value is used."""
    with urllib.request.urlopen(_child_url(make_run) + "/metrics", timeout=10) as r:
        text = r.read().decode()
    exposed = set()
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M):
        counter = kind == "counter" and not name.endswith("_total")
        exposed.add(name + "_total" if counter else name)
    doc = (Path(__file__).parent.parent / "docs" / "local.md").read_text()
    documented = set(re.findall(r"`(tokenpipe_local_\w+)", doc))
    assert len(documented) >= 9, documented
    assert documented <= exposed, sorted(documented - exposed)
