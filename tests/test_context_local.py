"""Context budgeting in front of the real local model (Gemma 3 270M on llama.cpp, 512 tokens).

The local engine answers a request that does not fit its window with a 400, as providers do;
through the gateway the same requests are answered. Its /local/stats records the prompt tokens
of each request by id, which shows what the summarising call was sent.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import yaml

from tests import procs
from tests.polling import until
from tokenpipe.engines.local.model import installed

pytestmark = [
    pytest.mark.local,
    pytest.mark.skipif(
        not installed() and not os.environ.get("CI"), reason="the `local` extra is not installed"
    ),
]

CTX = 512
MODEL = "gemma-3-270m"
_ids = itertools.count()


def conversation(turns: int, tag: str) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "You answer in one short line."}]
    for t in range(turns):
        msgs.append({"role": "user", "content": f"Note {tag}{t}: the box number {t} is red."})
        msgs.append({"role": "assistant", "content": f"Noted, box {t} is red."})
    msgs.append({"role": "user", "content": "Which colour is box 39?"})
    return msgs


@pytest.fixture(scope="module")
def local() -> Iterator[procs.Service]:
    with procs.Service("local", "--port", "0", "--ctx", str(CTX), name="local", timeout=120) as s:
        yield s


@pytest.fixture(scope="module")
def gateway(
    local: procs.Service, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[procs.Service]:
    config = {
        "upstreams": [{"name": "local", "url": local.url + "/v1"}],
        "context": {
            "margin_tokens": 8,
            "reserve_output_tokens": 32,
            "min_output_tokens": 8,
            "summary_max_tokens": 16,
            "summary_deadline_seconds": 120,
            # No window configured: the gateway reads the one the engine runs with (--ctx) from
            # its /v1/models (`max_model_len`), and counts with the model's own vocabulary.
        },
    }
    path = tmp_path_factory.mktemp("context-local") / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    with procs.gateway("--config", str(path)) as g:
        yield g


def post(
    url: str, messages: list[dict[str, Any]], headers: dict[str, str] | None = None, **extra: Any
) -> tuple[httpx.Response, str]:
    rid = f"ctx-local-{next(_ids)}"
    r = httpx.post(
        url + "/v1/chat/completions",
        json={"model": MODEL, "messages": messages, "temperature": 0, **extra},
        headers={"x-request-id": rid, **(headers or {})},
        timeout=300,
    )
    return r, rid


def records(local: procs.Service) -> dict[str, dict[str, Any]]:
    data = httpx.get(local.url + "/local/stats", params={"last": "1000", "times": "0"}).json()
    return {r["id"]: r for r in data["records"]}


def test_gateway_counts_prompt_tokens_exactly_like_the_local_model(local: procs.Service) -> None:
    from tokenpipe.context import tokens

    counter = tokens.open_counter("auto", MODEL, None)
    assert counter is not None and counter.exact
    msgs = conversation(3, "c")[1:]  # user/assistant turns (a system message merges into one)
    r, _ = post(local.url, msgs, max_tokens=1)
    counted = sum(tokens.count_messages(counter, msgs)) + counter.chat.reply
    assert r.json()["usage"]["prompt_tokens"] == counted


def test_max_tokens_too_large_is_a_400_from_the_model_but_lowered_by_the_gateway(
    local: procs.Service, gateway: procs.Service
) -> None:
    msgs = conversation(15, "m")  # ~480 tokens: room for a few dozen more
    direct, _ = post(local.url, msgs, max_tokens=100)
    assert direct.status_code == 400
    assert direct.json()["error"]["code"] == "context_length_exceeded"
    r, _ = post(gateway.url, msgs, max_tokens=100)
    assert r.status_code == 200, r.text
    lowered = int(r.headers["x-tokenpipe-max-tokens"])
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] + lowered <= CTX
    assert usage["completion_tokens"] <= lowered


def test_40_turn_conversation_over_the_window_is_answered_with_truncate(
    local: procs.Service, gateway: procs.Service
) -> None:
    msgs = conversation(40, "t")
    direct, _ = post(local.url, msgs, max_tokens=8)
    assert direct.status_code == 400  # ~1000 tokens in a 512-token window
    r, rid = post(gateway.url, msgs, max_tokens=8)
    assert r.status_code == 200, r.text
    assert r.headers["x-tokenpipe-context"].startswith("policy=truncate;")
    assert records(local)[rid]["prompt_tokens"] + 8 <= CTX


def test_40_turn_conversation_is_summarized_and_the_summary_reused_next_turn(
    local: procs.Service, gateway: procs.Service
) -> None:
    policy = {"x-tokenpipe-context-policy": "summarize"}
    msgs = conversation(40, "s")
    before = set(records(local))
    r, rid = post(gateway.url, msgs, headers=policy, max_tokens=8)
    assert r.status_code == 200, r.text
    assert r.headers["x-tokenpipe-context"].endswith("summary=new")
    recs = records(local)
    first = [v for k, v in recs.items() if k.startswith("ctx-summary-") and k not in before]
    assert len(first) == 1 and first[0]["outcome"] == "completed"
    assert recs[rid]["prompt_tokens"] + 8 <= CTX

    answer = r.json()["choices"][0]["message"]["content"]
    nxt = [
        *msgs,
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "And box 38?"},
    ]
    before = set(recs)
    r2, _ = post(gateway.url, nxt, headers=policy, max_tokens=8)
    assert r2.status_code == 200, r2.text
    report = r2.headers["x-tokenpipe-context"]
    assert report.endswith("summary=extended") or report.endswith("summary=reused")
    second = [
        v for k, v in records(local).items() if k.startswith("ctx-summary-") and k not in before
    ]
    # Only the newly dropped turns (and the previous summary) went to the summariser.
    assert all(s["prompt_tokens"] < first[0]["prompt_tokens"] / 2 for s in second)


async def test_a_configured_model_loads_its_tokenizer_before_any_request(
    sim: procs.Service, tmp_path: Any
) -> None:
    # Without the warm-up (context/lookup.warm) the first request loaded the GGUF vocabulary
    # itself: Server-Timing showed `context;dur=686` on make run's first request.
    config = tmp_path / "gw.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "upstreams": [{"name": "sim", "url": sim.url + "/v1"}],
                "context": {"models": [{"name": MODEL}]},
            }
        )
    )
    with procs.gateway("--config", str(config), "--log-level", "info") as gw:

        async def loaded() -> bool:
            return f"context: {MODEL} counts tokens with gguf:" in gw.output()

        await until(loaded, 60, "the tokenizer loaded at start")
