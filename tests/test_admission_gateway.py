"""Per-key quotas through the real gateway, as the official OpenAI SDK sees them."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests import procs


def _sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@pytest.fixture(scope="module")
def quota_gateway(sim: procs.Service, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    cfg = Path(tmp_path_factory.mktemp("admission")) / "tokenpipe.yaml"
    cfg.write_text(
        "auth:\n  api_keys:\n"
        f"    - {{name: alice, sha256: {_sha('sk-alice')}}}\n"
        f"    - {{name: bob, sha256: {_sha('sk-bob')}}}\n"
        f"    - {{name: carol, sha256: {_sha('sk-carol')}}}\n"
        "keys:\n"
        "  alice: {rpm: 60, bucket_seconds: 2}\n"
        "  bob: {max_concurrency: 1}\n"
        "  carol: {rpm: 60, bucket_seconds: 1}\n"
    )
    with procs.gateway("--upstream", sim.url + "/v1", "--config", str(cfg)) as g:
        yield g.url + "/v1"


def _client(url: str, key: str, retries: int) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key=key, max_retries=retries, timeout=30)


def _ask(client: openai.OpenAI, prompt: str = "hi") -> str:
    r = client.chat.completions.create(
        model="sim-model", messages=[{"role": "user", "content": prompt}], max_tokens=5
    )
    return r.choices[0].message.content or ""


def test_a_key_over_its_rpm_gets_an_openai_429_with_retry_after_and_limits(
    quota_gateway: str,
) -> None:
    alice = _client(quota_gateway, "sk-alice", retries=0)
    _ask(alice)
    _ask(alice)  # the 2-request bucket is now empty
    with pytest.raises(openai.RateLimitError) as e:
        _ask(alice)
    r = e.value.response
    assert r.status_code == 429
    assert r.headers["retry-after"] == "1"
    assert r.headers["x-ratelimit-limit-requests"] == "60"
    assert r.headers["x-ratelimit-remaining-requests"] == "0"
    assert e.value.code == "rate_limit_exceeded"
    # Another key is not affected by alice's budget.
    assert _ask(_client(quota_gateway, "sk-bob", retries=0))


def test_the_sdks_own_retry_waits_as_told_and_then_succeeds(quota_gateway: str) -> None:
    carol = _client(quota_gateway, "sk-carol", retries=0)
    _ask(carol)  # empties carol's 1-request bucket
    with pytest.raises(openai.RateLimitError):
        _ask(carol)
    # With the SDK's default retries, the same call succeeds: it waits for Retry-After.
    assert _ask(_client(quota_gateway, "sk-carol", retries=2))


def test_a_key_at_its_concurrency_quota_is_refused_until_its_request_ends(
    quota_gateway: str,
) -> None:
    bob = _client(quota_gateway, "sk-bob", retries=0)
    slow = bob.chat.completions.create(
        model="sim-model",
        messages=[{"role": "user", "content": "[[sim ttft_ms=800]] hi"}],
        max_tokens=5,
        stream=True,
    )
    with slow:  # headers are in: the request holds bob's only slot until the stream ends
        with pytest.raises(openai.RateLimitError) as e:
            _ask(bob)
        assert "concurrent" in e.value.message
        assert "".join(c.choices[0].delta.content or "" for c in slow if c.choices)
    # The slot is freed when the gateway's handler ends, a moment after the last byte.
    deadline = time.monotonic() + 5
    while True:
        try:
            assert _ask(bob)
            break
        except openai.RateLimitError:
            assert time.monotonic() < deadline, "bob's slot was never given back"
