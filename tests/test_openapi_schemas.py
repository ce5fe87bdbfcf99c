"""The gateway's /openapi.json (src/tokenpipe/front/openapi.json) describes requests the
gateway accepts: every schema in it is valid JSON Schema, each API route's request schema
admits requests as the official SDKs write them, and the bounds it states are the gateway's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from jsonschema import Draft202012Validator
from jsonschema.exceptions import ValidationError
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

DOC = json.loads(
    (Path(__file__).parent.parent / "src" / "tokenpipe" / "front" / "openapi.json").read_text()
)
REGISTRY = Registry().with_resource(
    "urn:tokenpipe-openapi", Resource.from_contents(DOC, default_specification=DRAFT202012)
)
USER = [{"role": "user", "content": "hi"}]
TOOL = {"name": "get_weather", "input_schema": {"type": "object"}}


def _request_schema(path: str) -> Draft202012Validator:
    schema = DOC["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    # Component references resolve against the whole document.
    text = json.dumps(schema).replace('"#/components/', '"urn:tokenpipe-openapi#/components/')
    return Draft202012Validator(json.loads(text), registry=REGISTRY)


def test_every_schema_in_the_document_is_valid_json_schema() -> None:
    for schema in DOC["components"]["schemas"].values():
        Draft202012Validator.check_schema(schema)
    for item in DOC["paths"].values():
        for op in item.values():
            for p in op.get("parameters", []):
                Draft202012Validator.check_schema(p["schema"])
            body = op.get("requestBody")
            if body:
                Draft202012Validator.check_schema(body["content"]["application/json"]["schema"])


ACCEPTED: list[tuple[str, dict[str, Any]]] = [
    ("/v1/responses", {"model": "m", "input": "hi"}),
    (
        "/v1/responses",
        {
            "model": "m",
            "instructions": "Be brief.",
            "input": [
                {"role": "developer", "content": "terse"},
                {
                    "type": "message",
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "What is this?"},
                        {"type": "input_image", "image_url": "https://x/y.png", "detail": "low"},
                    ],
                },
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "42"},
            ],
            "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
            "tool_choice": {"type": "function", "name": "f"},
            "text": {"format": {"type": "json_schema", "name": "a", "schema": {}}},
            "reasoning": {"effort": "low"},
            "stream": True,
            "stream_options": {"include_obfuscation": False},
            "max_output_tokens": 16,
            "metadata": {"k": "v"},
            "store": False,
        },
    ),
    ("/v1/embeddings", {"model": "m", "input": ["a", "b"], "encoding_format": "base64"}),
    ("/v1/embeddings", {"model": "m", "input": [[1, 2], [3]], "dimensions": 8}),
    ("/v1/messages", {"model": "m", "max_tokens": 16, "messages": USER}),
    (
        "/v1/messages",
        {
            "model": "m",
            "max_tokens": 2048,
            "system": [
                {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}
            ],
            "messages": [
                *USER,
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}],
                },
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "42"}],
                },
            ],
            "tools": [TOOL, {"type": "web_search_20250305", "name": "web_search"}],
            "tool_choice": {"type": "tool", "name": "get_weather"},
            "thinking": {"type": "enabled", "budget_tokens": 1024},
            "metadata": {"user_id": "u1"},
            "service_tier": "auto",
            "stream": True,
        },
    ),
    ("/v1/messages/count_tokens", {"model": "m", "messages": USER, "tools": [TOOL]}),
]


@pytest.mark.parametrize(("path", "body"), ACCEPTED)
def test_real_requests_fit_the_routes_schema(path: str, body: dict[str, Any]) -> None:
    _request_schema(path).validate(body)


REFUSED: list[tuple[str, dict[str, Any]]] = [
    ("/v1/responses", {"input": "hi"}),  # the gateway's 400s, stated in the schema
    ("/v1/responses", {"model": "m", "input": "hi", "max_output_tokens": 0}),
    ("/v1/responses", {"model": "m", "input": "hi", "temperature": 3}),
    ("/v1/embeddings", {"model": "m", "input": []}),
    ("/v1/messages", {"model": "m", "messages": USER}),  # no max_tokens
    ("/v1/messages", {"model": "m", "max_tokens": 1, "messages": []}),
    ("/v1/messages", {"model": "m", "max_tokens": 1, "messages": USER, "temperature": 1.5}),
    ("/v1/messages/count_tokens", {"model": "", "messages": USER}),
]


@pytest.mark.parametrize(("path", "body"), REFUSED)
def test_what_the_gateway_refuses_the_schema_refuses(path: str, body: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        _request_schema(path).validate(body)


def test_the_pace_header_states_the_gateways_bound() -> None:
    from tokenpipe.control.pacing import MAX_RATE

    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses"):
        params = {p["name"]: p for p in DOC["paths"][path]["post"]["parameters"]}
        assert params["x-tokenpipe-max-tokens-per-second"]["schema"]["maximum"] == MAX_RATE
