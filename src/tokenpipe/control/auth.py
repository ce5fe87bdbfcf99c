"""API-key authentication. Keys are stored only as SHA-256 digests and compared in constant time."""

from __future__ import annotations

import hashlib
import hmac

from tokenpipe.errors import GatewayError
from tokenpipe.settings import ApiKey

ANONYMOUS = "anonymous"


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class Authenticator:
    def __init__(self, keys: list[ApiKey]) -> None:
        self._keys = [(k.name, bytes.fromhex(k.sha256)) for k in keys]

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
        presented = hashlib.sha256(credentials.encode()).digest()
        found = None
        # Compare against every digest so the time taken does not say which one matched.
        for name, want in self._keys:
            if hmac.compare_digest(presented, want) and found is None:
                found = name
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
