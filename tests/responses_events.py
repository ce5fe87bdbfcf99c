"""Checks of Responses API events and bodies against the contract: the official SDK's types
(pydantic, strict about every field it declares) and the OpenAI spec's schemas
(tests/data/openai-responses-schemas.json)."""

from __future__ import annotations

import itertools
import json
from functools import cache
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator
from openai.types import CreateEmbeddingResponse
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from tokenpipe import sse

SCHEMAS = Path(__file__).parent / "data" / "openai-responses-schemas.json"
_EVENT = TypeAdapter(ResponseStreamEvent)


@cache
def _validator(name: str) -> Draft202012Validator:
    doc = json.loads(SCHEMAS.read_text())
    registry = Registry().with_resource(
        "urn:openai-responses", Resource.from_contents(doc, default_specification=DRAFT202012)
    )
    schema = {"$ref": f"urn:openai-responses#/components/schemas/{name}"}
    return Draft202012Validator(schema, registry=registry)


def validate(name: str, instance: Any) -> None:
    """`instance` against the spec's schema `name` (raises jsonschema's ValidationError)."""
    _validator(name).validate(instance)


@cache
def _event_schemas() -> dict[str, str]:
    """Event type -> the name of its schema in ResponseStreamEvent's union."""
    schemas = json.loads(SCHEMAS.read_text())["components"]["schemas"]
    out = {}
    for ref in schemas["ResponseStreamEvent"]["anyOf"]:
        name = ref["$ref"].rsplit("/", 1)[1]
        for kind in schemas[name]["properties"]["type"]["enum"]:
            out[kind] = name
    return out


def check_response(obj: dict[str, Any]) -> Response:
    validate("Response", obj)
    return Response.model_validate(obj)


def check_embeddings(obj: dict[str, Any]) -> None:
    validate("CreateEmbeddingResponse", obj)
    CreateEmbeddingResponse.model_validate(obj)


def parse(data: bytes) -> list[dict[str, Any]]:
    """The events of a Responses SSE body; each `event:` name is its JSON's `type`."""
    out = []
    for ev in sse.SSEDecoder().feed(data):
        if ev.comment:
            continue
        obj = json.loads(ev.data)
        assert ev.event in (None, obj["type"]), (ev.event, obj["type"])
        out.append(obj)
    return out


def check_events(events: list[dict[str, Any]], schema_too: bool = True) -> None:
    """Every event is a valid ResponseStreamEvent (SDK, and the spec unless `schema_too` is
    False); sequence numbers increase strictly; it starts with `response.created`; one
    terminal event, last."""
    assert events and events[0]["type"] == "response.created", events[:1]
    for e in events:
        _EVENT.validate_python(e)
        if schema_too:  # its own type's schema (the union's error would not say why)
            validate(_event_schemas()[e["type"]], e)
    seqs = [e["sequence_number"] for e in events]
    assert all(a < b for a, b in itertools.pairwise(seqs)), seqs
    terminal = ("response.completed", "response.incomplete", "response.failed", "error")
    assert [e["type"] for e in events if e["type"] in terminal] == [events[-1]["type"]]


def text_of(events: list[dict[str, Any]]) -> str:
    return "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
