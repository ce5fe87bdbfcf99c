"""What a URL points at, where it matters to the user: a tokenpipe gateway drops every
request header it does not own (`x-sim-*` included), so a fault injected with
`--header x-sim-fault:...` through a gateway never reaches the sim and the doctor reports
"no findings" for a stall that was never made. Bench and doctor warn about that trap.
"""

from __future__ import annotations

from urllib.parse import urlsplit

import aiohttp
import orjson

#: Headers only `tokenpipe sim` reads (docs: `tokenpipe sim --help`).
SIM_PREFIX = "x-sim-"
#: Bytes of /readyz read at most (the gateway's answer is ~20 bytes).
_READ_MAX = 4096


def sim_headers(headers: dict[str, str]) -> list[str]:
    return sorted(h for h in headers if h.lower().startswith(SIM_PREFIX))


async def is_tokenpipe_gateway(url: str, timeout_s: float = 3.0) -> bool:
    """True if `url`'s host answers `GET /readyz` as the gateway does: 200 `{"status":
    "ready"}` or 503 with error code `draining`. The sim and `tokenpipe local` serve no
    /readyz (404). Any failure (refused, timeout, not JSON) is False: this only decides a
    warning, never whether to run."""
    parts = urlsplit(url)
    root = f"{parts.scheme or 'http'}://{parts.netloc}"
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    try:
        async with (
            aiohttp.ClientSession(timeout=timeout) as s,
            s.get(root + "/readyz", allow_redirects=False) as r,
        ):
            body = orjson.loads(await r.content.read(_READ_MAX))
    except (aiohttp.ClientError, TimeoutError, OSError, ValueError):
        return False
    if not isinstance(body, dict):
        return False
    if r.status == 200:
        return body.get("status") == "ready"
    err = body.get("error")
    return r.status == 503 and isinstance(err, dict) and err.get("code") == "draining"


def gateway_warning(names: list[str]) -> str:
    """One line naming the headers that cannot arrive."""
    return (
        f"warning: {', '.join(names)} will not reach the upstream: this URL is a tokenpipe "
        "gateway, which does not forward x-sim-* headers; point at the sim itself to inject "
        "faults"
    )


async def sim_header_warning(url: str, headers: dict[str, str]) -> str | None:
    """The warning to print, or None (no x-sim-* header, or not a gateway)."""
    names = sim_headers(headers)
    if names and await is_tokenpipe_gateway(url):
        return gateway_warning(names)
    return None
