"""`GET /v1/models` and `GET /v1/models/{model}` for both APIs' clients, on real loopback
sockets with the official SDKs: an Anthropic client (it sends `anthropic-version`) gets
Anthropic's paged list, every item valid as the SDK's ModelInfo, with its key as `x-api-key`
and its errors in Anthropic's shape; an OpenAI client gets OpenAI's list as before. Both
SDKs' `models.retrieve` get one listed model, or their own not-found error."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import anthropic
import httpx
import openai
import pytest
from pydantic import TypeAdapter

from tests import procs
from tokenpipe.errors import GatewayError
from tokenpipe.front.models import anthropic_page

KEY = "sk-test-models"
#: More than one of Anthropic's default pages (20); the last has a slash, as fine-tunes and
#: hub models do (sorted last).
MODELS = [*(f"model-{i:02d}" for i in range(25)), "org/tuned-1"]
MODEL_INFO = TypeAdapter(anthropic.types.ModelInfo)
ANTHROPIC = {"anthropic-version": "2023-06-01"}


@pytest.fixture(scope="module")
def gateway(
    sim: procs.Service, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[procs.Service]:
    """One client key; the models configured on an OpenAI upstream and an Anthropic one."""
    cfg = tmp_path_factory.mktemp("models") / "gw.yaml"
    digest = hashlib.sha256(KEY.encode()).hexdigest()
    cfg.write_text(
        f"auth:\n  api_keys:\n    - name: team\n      sha256: {digest}\n"
        f"upstreams:\n  - {{name: oai, url: '{sim.url}/v1', models: {MODELS[:20]}}}\n"
        f"  - {{name: claude, api: anthropic, url: '{sim.url}/v1', models: {MODELS[20:]}}}\n"
    )
    with procs.gateway("--config", str(cfg)) as g:
        yield g


def test_the_anthropic_sdk_lists_every_model_across_pages(gateway: procs.Service) -> None:
    with anthropic.Anthropic(base_url=gateway.url, api_key=KEY, max_retries=0) as client:
        first = client.models.list()
        assert [m.id for m in first.data] == MODELS[:20]  # Anthropic's default page
        assert first.has_more and first.first_id == MODELS[0] and first.last_id == MODELS[19]
        listed = list(client.models.list())  # the SDK pages on by after_id
        assert [m.id for m in listed] == MODELS
        assert all(m.type == "model" and m.display_name == m.id for m in listed)
        back = client.models.list(before_id=MODELS[5], limit=3)
        assert [m.id for m in back.data] == MODELS[2:5] and back.has_more


def test_each_item_is_valid_as_the_sdks_model_info(gateway: procs.Service) -> None:
    r = httpx.get(gateway.url + "/v1/models?limit=1000", headers={**ANTHROPIC, "x-api-key": KEY})
    assert r.status_code == 200
    page = r.json()
    assert set(page) == {"data", "has_more", "first_id", "last_id"}
    assert page["has_more"] is False
    assert (page["first_id"], page["last_id"]) == (MODELS[0], MODELS[-1])
    for item in page["data"]:
        info = MODEL_INFO.validate_python(item)
        assert info.created_at.isoformat() == "1970-01-01T00:00:00+00:00"


@pytest.mark.parametrize(
    ("headers", "query", "status", "kind"),
    [
        ({}, "", 401, "authentication_error"),
        ({"x-api-key": "wrong"}, "", 401, "authentication_error"),
        ({"x-api-key": KEY}, "?limit=0", 400, "invalid_request_error"),
        ({"x-api-key": KEY}, "?after_id=a&before_id=b", 400, "invalid_request_error"),
    ],
)
def test_an_anthropic_clients_errors_are_in_anthropics_shape(
    gateway: procs.Service, headers: dict[str, str], query: str, status: int, kind: str
) -> None:
    r = httpx.get(gateway.url + "/v1/models" + query, headers={**ANTHROPIC, **headers})
    assert r.status_code == status
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == kind, body
    assert set(body["error"]) == {"type", "message"}


def test_the_sdk_raises_its_own_errors(gateway: procs.Service) -> None:
    client = anthropic.Anthropic(base_url=gateway.url, api_key="wrong", max_retries=0)
    with client, pytest.raises(anthropic.AuthenticationError) as e:
        client.models.list()
    assert isinstance(e.value.body, dict) and e.value.body["type"] == "error"


def test_a_wrong_method_is_a_405_in_the_clients_shape(gateway: procs.Service) -> None:
    r = httpx.post(gateway.url + "/v1/models", headers=ANTHROPIC)
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(gateway.url + "/v1/models")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"


def test_an_openai_client_gets_openais_list_with_a_bearer_key_only(
    gateway: procs.Service,
) -> None:
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=KEY, max_retries=0)
    models = client.models.list()
    assert [m.id for m in models.data] == MODELS
    assert all(m.object == "model" for m in models.data)
    r = httpx.get(gateway.url + "/v1/models", headers={"x-api-key": KEY})
    assert r.status_code == 401 and r.json()["error"]["code"] == "missing_api_key"


def test_pages_follow_the_cursors_in_either_direction() -> None:
    names = ["a", "b", "c", "d", "e"]

    def ids(**query: str) -> tuple[list[object], object]:
        page = anthropic_page(names, query)
        data = page["data"]
        assert isinstance(data, list)
        return [m["id"] for m in data], page["has_more"]

    assert ids(limit="2") == (["a", "b"], True)
    assert ids(limit="2", after_id="b") == (["c", "d"], True)
    assert ids(limit="2", after_id="c") == (["d", "e"], False)
    assert ids(after_id="bb") == (["c", "d", "e"], False)  # a name no longer listed
    assert ids(limit="2", before_id="e") == (["c", "d"], True)
    assert ids(limit="2", before_id="c") == (["a", "b"], False)
    assert ids(after_id="e") == ([], False)
    assert anthropic_page(names, {"after_id": "e"})["first_id"] is None
    for bad in ("0", "1001", "x", "1" * 5000):
        with pytest.raises(GatewayError) as e:
            anthropic_page(names, {"limit": bad})
        assert e.value.status == 400 and e.value.param == "limit"
    with pytest.raises(GatewayError):
        anthropic_page(names, {"after_id": "a", "before_id": "c"})


def test_both_sdks_retrieve_a_listed_model_slashes_included(gateway: procs.Service) -> None:
    with openai.OpenAI(base_url=gateway.url + "/v1", api_key=KEY, max_retries=0) as client:
        for name in (MODELS[3], MODELS[-1]):
            model = client.models.retrieve(name)
            assert (model.id, model.object, model.owned_by) == (name, "model", "tokenpipe")
    with anthropic.Anthropic(base_url=gateway.url, api_key=KEY, max_retries=0) as claude:
        for name in (MODELS[21], MODELS[-1]):
            info = claude.models.retrieve(name)
            assert (info.id, info.type, info.display_name) == (name, "model", name)
    r = httpx.get(
        gateway.url + "/v1/models/org%2Ftuned-1", headers={"Authorization": "Bearer " + KEY}
    )
    assert r.status_code == 200 and r.json()["id"] == "org/tuned-1"  # an encoded slash alike


def test_a_model_not_listed_is_each_sdks_not_found_error(gateway: procs.Service) -> None:
    with openai.OpenAI(base_url=gateway.url + "/v1", api_key=KEY, max_retries=0) as client:
        with pytest.raises(openai.NotFoundError) as e:
            client.models.retrieve("model-99")
        assert e.value.code == "model_not_found" and e.value.param == "model"
        with pytest.raises(openai.AuthenticationError):
            client.with_options(api_key="wrong").models.retrieve(MODELS[0])
    with anthropic.Anthropic(base_url=gateway.url, api_key=KEY, max_retries=0) as claude:
        with pytest.raises(anthropic.NotFoundError) as a:
            claude.models.retrieve("model-99")
        assert isinstance(a.value.body, dict) and a.value.body["type"] == "error"
        assert a.value.body["error"]["type"] == "not_found_error"
    r = httpx.get(gateway.url + "/v1/models/", headers={"Authorization": "Bearer " + KEY})
    assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_route"  # no id
    r = httpx.delete(gateway.url + "/v1/models/" + MODELS[0], headers=ANTHROPIC)
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"
