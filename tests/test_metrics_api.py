"""The request metrics' `api` label: each API's requests, through the gateway to the sim on
loopback with the official SDKs as clients, count under their own route's value (one of
metrics.APIS), natively and translated; no other value appears."""

from __future__ import annotations

import re
from collections.abc import Iterator

import anthropic
import openai
import pytest

from tests import procs
from tests.polling import metrics
from tests.test_api_responses import sample
from tokenpipe.dialects import CHAT, COMPLETIONS, COUNT_TOKENS, MESSAGES
from tokenpipe.dialects.chat_via_messages import ChatViaMessages
from tokenpipe.dialects.embeddings import EMBEDDINGS
from tokenpipe.dialects.messages_via_chat import MessagesViaChat
from tokenpipe.dialects.responses import ResponsesDialect
from tokenpipe.dialects.responses_chat import ResponsesViaChat
from tokenpipe.observe.metrics import APIS

#: Served natively by `claude` only; sim-model by `oai` only (a Messages request for it is
#: translated onto chat).
CLAUDE = "claude-sim"
PROMPT = "Tell me about pipes."


def test_every_dialect_labels_its_requests_with_one_of_the_apis() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    labels = {
        d.name: d.label
        for d in (
            CHAT,
            COMPLETIONS,
            MESSAGES,
            COUNT_TOKENS,
            EMBEDDINGS,
            ResponsesDialect(),
            ResponsesViaChat({"model": "m", "input": "hi"}),
            MessagesViaChat(body),
        )
    }
    assert labels == {
        "chat": "chat",
        "completions": "completions",
        "messages": "messages",
        "count_tokens": "messages",  # a route of the Messages API
        "embeddings": "embeddings",
        "responses": "responses",
    }
    assert ChatViaMessages(body).label == "chat"  # translated: still the client's API
    assert set(labels.values()) == set(APIS)


@pytest.fixture(scope="module")
def gateway(
    sim: procs.Service, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[procs.Service]:
    """An OpenAI upstream and an Anthropic one, both the shared sim."""
    cfg = tmp_path_factory.mktemp("metrics-api") / "gw.yaml"
    cfg.write_text(
        "upstreams:\n"
        f"  - {{name: oai, url: '{sim.url}/v1', models: [sim-model]}}\n"
        f"  - {{name: claude, api: anthropic, url: '{sim.url}/v1', models: [{CLAUDE}]}}\n"
    )
    with procs.gateway("--config", str(cfg)) as g:
        yield g


async def test_each_api_counts_under_its_own_label(gateway: procs.Service) -> None:
    oai = openai.OpenAI(base_url=gateway.url + "/v1", api_key="k", max_retries=0)
    with anthropic.Anthropic(base_url=gateway.url, api_key="k", max_retries=0) as claude:
        msg = [{"role": "user", "content": PROMPT}]
        with claude.messages.stream(model=CLAUDE, max_tokens=50, messages=msg) as s:  # type: ignore[arg-type]
            s.get_final_message()
        claude.messages.count_tokens(model=CLAUDE, messages=msg)  # type: ignore[arg-type]
        # Translated onto the OpenAI upstream: still a Messages client.
        claude.messages.create(model="sim-model", max_tokens=50, messages=msg)  # type: ignore[arg-type]
    with oai.responses.stream(model="sim-model", input=PROMPT) as r:
        r.get_final_response()
    oai.embeddings.create(model="sim-model", input=["one", "two"])
    oai.chat.completions.create(model="sim-model", messages=msg)  # type: ignore[arg-type]
    oai.completions.create(model="sim-model", prompt=PROMPT, max_tokens=5)
    m = await metrics(gateway)

    def requests(api: str, upstream: str, model: str = "sim-model") -> float:
        labels = {"api": api, "upstream": upstream, "model": model}
        return sample(m, "tokenpipe_requests_total", status="200", **labels)

    assert requests("messages", "claude", CLAUDE) == 2  # the stream and count_tokens
    assert requests("messages", "oai") == 1
    assert requests("responses", "oai") == 1
    assert requests("embeddings", "oai") == 1
    assert requests("chat", "oai") == 1
    assert requests("completions", "oai") == 1
    streamed = {"api": "messages", "upstream": "claude", "model": CLAUDE}
    assert sample(m, "tokenpipe_ttft_seconds_count", **streamed) == 1
    streamed = {"api": "responses", "upstream": "oai", "model": "sim-model"}
    assert sample(m, "tokenpipe_ttft_seconds_count", **streamed) == 1
    assert sample(m, "tokenpipe_tokens_total", kind="prompt", **streamed) > 0
    embeddings = {"api": "embeddings", "upstream": "oai", "model": "sim-model"}
    assert sample(m, "tokenpipe_tokens_total", kind="prompt", **embeddings) == 2
    assert sample(m, "tokenpipe_inflight_requests", **embeddings) == 0
    seen = {v for k in m for v in re.findall(r'\bapi="([^"]*)"', k)}
    assert seen == set(APIS)
