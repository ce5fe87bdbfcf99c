"""POST /v1/embeddings through the gateway to the sim, with the official SDK as the client:
the same vectors as the upstream gives, the upstream limiter charged the input's tokens (and
no output), a 5xx answered by the next upstream."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import openai
import pytest

from tests import procs
from tests.polling import metrics
from tests.responses_events import check_embeddings
from tests.test_api_responses import sample


def _client(service: procs.Service) -> openai.OpenAI:
    return openai.OpenAI(base_url=service.url + "/v1", api_key="unused", max_retries=0)


def test_embeddings_through_the_gateway_are_the_upstreams(
    sim: procs.Service, gateway: procs.Service
) -> None:
    inputs = ["the quick brown fox", "jumps over", "the quick brown fox"]
    direct = _client(sim).embeddings.create(model="sim-model", input=inputs)
    via = _client(gateway).embeddings.create(model="sim-model", input=inputs)  # base64 asked
    assert [d.embedding for d in via.data] == [d.embedding for d in direct.data]
    assert via.data[0].embedding == via.data[2].embedding != via.data[1].embedding
    assert len(via.data[0].embedding) == 16 and via.usage == direct.usage
    raw = _client(gateway).embeddings.with_raw_response.create(
        model="sim-model", input="one", encoding_format="float", dimensions=8
    )
    body = json.loads(raw.content)
    check_embeddings(body)
    assert len(body["data"][0]["embedding"]) == 8
    assert body["usage"] == {"prompt_tokens": 1, "total_tokens": 1}


def test_a_malformed_input_is_a_400_naming_it(gateway: procs.Service) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        _client(gateway).post(
            "/embeddings", cast_to=object, body={"model": "sim-model", "input": [{"a": 1}]}
        )
    error = e.value.body
    assert isinstance(error, dict) and error["param"] == "input[0]", error


@pytest.fixture
def limited(sim: procs.Service, tmp_path: Path) -> Iterator[procs.Service]:
    """A gateway whose upstream bucket holds 120 tokens (2 a second), waiting 0.3 s at most."""
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(
        f"upstreams:\n  - {{name: sim, url: '{sim.url}/v1'}}\n"
        "limits:\n  queue_deadline_seconds: 0.3\n  upstreams:\n    sim: {tpm: 120}\n"
    )
    with procs.gateway("--config", str(cfg)) as g:
        yield g


async def test_the_limiter_charges_the_inputs_tokens_and_no_output(
    limited: procs.Service,
) -> None:
    """50 words cost 50 tokens: two fit in the bucket, the third waits past the deadline.
    (Were an output reserved, as for a completion without max_tokens, 256 + 50 would not fit
    even once.)"""
    body = {"model": "sim-model", "input": ["w " * 25, "w " * 25]}
    statuses = []
    async with aiohttp.ClientSession() as s:
        for _ in range(3):
            async with s.post(limited.url + "/v1/embeddings", json=body) as r:
                statuses.append(r.status)
                if r.status == 200:
                    assert (await r.json())["usage"]["prompt_tokens"] == 50
                else:
                    assert "Retry-After" in r.headers
    assert statuses == [200, 200, 429]


@pytest.fixture
def failing_first(tmp_path: Path) -> Iterator[tuple[procs.Service, procs.Service, procs.Service]]:
    """(a sim that always answers 500, a healthy one, a gateway over both in that order)."""
    with (
        procs.sim("--ttft-ms", "1", "--fault", "status:500@1") as bad,
        procs.sim("--ttft-ms", "1") as good,
    ):
        cfg = tmp_path / "gw.yaml"
        cfg.write_text(
            "upstreams:\n"
            f"  - {{name: bad, url: '{bad.url}/v1'}}\n"
            f"  - {{name: good, url: '{good.url}/v1'}}\n"
        )
        with procs.gateway("--config", str(cfg)) as g:
            yield bad, good, g


async def test_a_5xx_is_retried_on_the_next_upstream(
    failing_first: tuple[procs.Service, procs.Service, procs.Service],
) -> None:
    bad, good, gw = failing_first
    got = _client(gw).embeddings.create(model="sim-model", input="hello")
    assert len(got.data) == 1 and got.usage.prompt_tokens == 1
    async with aiohttp.ClientSession() as s:
        stats = []
        for sim in (bad, good):
            async with s.get(sim.url + "/sim/stats") as r:
                stats.append(await r.json())
    assert [r["status"] for r in stats[0]["records"]] == [500]
    assert [(r["kind"], r["outcome"]) for r in stats[1]["records"]] == [("embeddings", "completed")]
    m = await metrics(gw)
    labels = {"api": "embeddings", "model": "sim-model", "upstream": "good"}
    assert sample(m, "tokenpipe_requests_total", status="200", **labels) == 1
    assert sample(m, "tokenpipe_retries_total", reason="status_5xx", outcome="retried") == 1
