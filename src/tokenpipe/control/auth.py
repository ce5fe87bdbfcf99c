"""API-key authentication. Keys are stored only as SHA-256 digests; a presented key is
found by its digest.

A key is looked up by its digest in a dict: one hash and one compare, whatever the number of
keys (a config may hold MAX_API_KEYS). The time a lookup takes can depend on the digest's
bytes, but a digest is SHA-256 of what the client sent: learning how far it matches a
stored one tells nothing about the key behind that one (finding a key for a chosen digest
prefix is a preimage search), the reason services that keep hashed tokens look them up by
digest. Comparing the digest with every key's in constant time, as this did, cost ~55 ns a
key on each request, a refused one too: 0.5 ms a request with 10,000 keys, 5.5 ms with
100,000 (benchmarks/auth_keys.py).
"""

from __future__ import annotations

import hashlib

from tokenpipe.errors import GatewayError
from tokenpipe.settings import ApiKey

ANONYMOUS = "anonymous"


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class Authenticator:
    def __init__(self, keys: list[ApiKey]) -> None:
        #: Key names by digest. A digest listed twice names its first entry's key.
        self._keys: dict[bytes, str] = {}
        for k in keys:
            self._keys.setdefault(bytes.fromhex(k.sha256), k.name)

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def check(self, authorization: str | None) -> str:
        """Returns the key's name, or raises 401. The presented key never reaches a message."""
        if not self._keys:
            return ANONYMOUS
        credentials = _bearer(authorization)
        if credentials is None:
            raise GatewayError(
                401,
                "You didn't provide an API key. Send it as 'Authorization: Bearer YOUR_KEY'.",
                code="missing_api_key",
            )
        return self._match(credentials)

    def check_any(self, authorization: str | None, api_key: str | None) -> str:
        """`check` for routes whose clients send `x-api-key` (Anthropic's SDKs do; their
        `auth_token` sends a bearer token): either header is accepted, x-api-key first."""
        if not self._keys:
            return ANONYMOUS
        credentials = api_key.strip() if api_key is not None and api_key.strip() else None
        if credentials is None:
            credentials = _bearer(authorization)
        if credentials is None:
            raise GatewayError(
                401,
                "You didn't provide an API key. Send it as 'x-api-key: YOUR_KEY' "
                "or 'Authorization: Bearer YOUR_KEY'.",
                code="missing_api_key",
            )
        return self._match(credentials)

    def _match(self, credentials: str) -> str:
        found = self._keys.get(hashlib.sha256(credentials.encode()).digest())
        if found is None:
            raise GatewayError(401, "Incorrect API key provided.", code="invalid_api_key")
        return found


def _bearer(authorization: str | None) -> str | None:
    """The credentials of `Authorization: Bearer ...`; None when there are none."""
    # The scheme is case-insensitive (RFC 9110 section 11.1): "bearer" and "BEARER" count.
    scheme, _, credentials = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not credentials.strip():
        return None
    return credentials.strip()
