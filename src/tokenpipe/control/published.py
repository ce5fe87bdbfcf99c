"""Published context windows of well-known models: the cap on a request's cost (control/
cost.py) and the context hop's last resort when neither the config nor the upstream says."""

from __future__ import annotations

import functools

#: Published context windows (tokens), from OpenAI's model pages. Prefix match, longest first.
KNOWN_WINDOWS: dict[str, int] = {
    "gpt-4.1": 1_047_576,
    "gpt-4o": 128_000,
    "gpt-4-turbo": 128_000,
    "gpt-4-32k": 32_768,
    "gpt-4": 8_192,
    "gpt-3.5-turbo": 16_385,
    "o1": 200_000,
    "o3": 200_000,
    "o4-mini": 200_000,
}
_PREFIXES = sorted(KNOWN_WINDOWS, key=len, reverse=True)  # longest match first


@functools.lru_cache(maxsize=1024)
def known_window(model: str) -> int | None:
    for prefix in _PREFIXES:
        if model.startswith(prefix):
            return KNOWN_WINDOWS[prefix]
    return None
