"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the right status."""

from __future__ import annotations

import math
import re

import orjson

#: status -> OpenAI error type
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "api_error",
    502: "upstream_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


#: The field a msgspec validation error names at its end: "... - at `$.messages[0].role`".
VALIDATION_FIELD = re.compile(r" - at `\$\.?([^`]*)`$")


def validation_field(message: str) -> str | None:
    """The field (as OpenAI's `param`) a msgspec validation error's message names, if any."""
    m = VALIDATION_FIELD.search(message)
    return m.group(1) if m else None


#: Characters of an error's message, and of its `param`: some quote what a peer sent (a
#: field's value, an upstream's own message), which may be megabytes long. Past it: cut.
MAX_MESSAGE, MAX_PARAM = 2048, 256


class GatewayError(Exception):
    """An error the client is told about. Never carries secrets or stack traces."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
        retry_after: float | None = None,
    ) -> None:
        if len(message) > MAX_MESSAGE:
            message = message[:MAX_MESSAGE] + "..."
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param[:MAX_PARAM] if param is not None else None
        self.type = type or _TYPES.get(status, "api_error")
        self.headers = dict(headers or {})
        if status == 429 or retry_after is not None:
            # The contract: a 429 always carries Retry-After (whole seconds, rounded up, >= 1).
            ra = 1.0 if retry_after is None else retry_after
            self.headers.setdefault("Retry-After", str(max(1, math.ceil(ra))))
            self.headers.setdefault("retry-after-ms", str(max(1, int(ra * 1000))))

    def body(self) -> dict[str, object]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def json(self) -> bytes:
        return orjson.dumps(self.body())


def error_body(status: int, message: str, code: str | None = None) -> bytes:
    return GatewayError(status, message, code=code).json()


def dumps_request(obj: object) -> bytes:
    """A client's request `obj` (as decoded) written as JSON again. orjson reads 1,024 levels
    of nesting but writes only 255: a body nested deeper is the client's 400, not a 500."""
    try:
        return orjson.dumps(obj)
    except orjson.JSONEncodeError as e:
        raise GatewayError(
            400, f"The request could not be written again as JSON: {e}.", code="invalid_request"
        ) from None
