"""docs/config.md documents every settings key: each field of every settings struct appears in
it by name, so a new key cannot ship undocumented."""

from __future__ import annotations

import typing
from pathlib import Path

import msgspec

from tokenpipe import settings

DOC = Path(__file__).parent.parent / "docs" / "config.md"
#: Sections being written right now, documented when their issue closes (issue 7: tail).
PENDING: set[str] = set()


def _keys(struct: type[msgspec.Struct], prefix: str = "") -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for f in msgspec.structs.fields(struct):
        full = prefix + f.name
        out.append((full, f.name))
        stack = [f.type]
        while stack:
            t = stack.pop()
            if isinstance(t, type) and issubclass(t, msgspec.Struct):
                out += _keys(t, full + ".")
            else:
                stack += list(typing.get_args(t))
    return out


def test_every_settings_key_is_in_docs_config_md() -> None:
    doc = DOC.read_text()
    keys = _keys(settings.Settings)
    assert len(keys) > 50
    missing = [
        full
        for full, name in keys
        if full.split(".", 1)[0] not in PENDING and f"`{name}`" not in doc and f"{name}:" not in doc
    ]
    assert not missing, f"undocumented in docs/config.md: {missing}"
