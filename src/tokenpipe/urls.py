"""What an upstream URL and a header value may hold: checked where the config and the command
line are read (settings, cli_support), so a mistake is one line at start-up, not a traceback
at the first request."""

from __future__ import annotations

from urllib.parse import urlsplit


def has_control_characters(text: str) -> bool:
    """A line break or another control character (C0 or DEL): what no header value may hold."""
    return any(ord(c) < 32 or ord(c) == 127 for c in text)


def url_problem(url: str, base_url: bool = True) -> str | None:
    """What is wrong with an upstream's base URL, or None. Each of these was a traceback at
    the first request (or start-up), or a URL that no path could be added to. `base_url`
    False: only whether it is an http(s) URL with a host (a bench's target may name its
    endpoint, query included)."""
    if any(c.isspace() or ord(c) < 32 for c in url):
        return "an upstream URL may not hold spaces or control characters"
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError when not a number in 0-65535
        url.encode()  # bytes that are not UTF-8 came in as surrogates (argv, a file's name)
        (parts.hostname or "").encode("idna")
    except UnicodeError:  # before ValueError: it is one, and its text quotes the bad bytes
        return "not a valid upstream URL (bytes that are not UTF-8, or not a host name)"
    except ValueError as e:
        return f"not a valid upstream URL ({e})"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "an upstream URL needs http:// or https:// and a host"
    if not base_url:
        return None
    if parts.username is not None or parts.password is not None:
        # Never quoted back: it holds a secret.
        return (
            "an upstream URL may not hold credentials (they would be logged): put the key "
            "in an environment variable named by the config's `api_key_env` (docs/config.md)"
        )
    if parts.query or parts.fragment:
        return "an upstream URL is a base URL: no ?query or #fragment (paths are added to it)"
    return None


def normalise_base_url(url: str) -> str:
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"
