from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from jsonschema import Draft202012Validator
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from tests import procs

SCHEMAS = Path(__file__).parent / "data" / "openai-schemas.json"


@pytest.fixture(scope="session")
def sim() -> Iterator[procs.Service]:
    """A fast sim shared by tests that only read from it: 10 ms TTFT, 1 ms per token."""
    with procs.sim("--ttft-ms", "10", "--itl-ms", "1", "--output-tokens", "20") as s:
        yield s


@pytest.fixture(scope="session")
def gateway(sim: procs.Service) -> Iterator[procs.Service]:
    with procs.gateway("--upstream", sim.url + "/v1") as g:
        yield g


class OpenAISchemas:
    def __init__(self) -> None:
        doc = json.loads(SCHEMAS.read_text())
        self.registry = Registry().with_resource(
            "urn:openai-schemas", Resource.from_contents(doc, default_specification=DRAFT202012)
        )
        self.schemas = doc["components"]["schemas"]

    def validate(self, name: str, instance: Any) -> None:
        schema = {"$ref": f"urn:openai-schemas#/components/schemas/{name}"}
        Draft202012Validator(schema, registry=self.registry).validate(instance)


@pytest.fixture(scope="session")
def openai_schemas() -> OpenAISchemas:
    return OpenAISchemas()
