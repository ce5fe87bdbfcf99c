"""API keys found by their digest: the right name among many, the first of two entries with
one digest, and 401s that say what was wrong without the key."""

from __future__ import annotations

import pytest

from tokenpipe.control.auth import ANONYMOUS, Authenticator, digest
from tokenpipe.errors import GatewayError
from tokenpipe.settings import ApiKey


def _keys(n: int) -> list[ApiKey]:
    return [ApiKey(name=f"team-{i}", sha256=digest(f"sk-{i}")) for i in range(n)]


def test_each_key_among_thousands_is_found_by_its_digest() -> None:
    auth = Authenticator(_keys(5_000))
    for i in (0, 1, 2_500, 4_999):
        assert auth.check(f"Bearer sk-{i}") == f"team-{i}"
        assert auth.check(f"bearer   sk-{i} ") == f"team-{i}"  # any case, blanks around
        assert auth.check_any(None, f"sk-{i}") == f"team-{i}"  # x-api-key
    upper = ApiKey(name="upper", sha256=digest("sk-upper").upper())  # hex in either case
    assert Authenticator([upper]).check("Bearer sk-upper") == "upper"


def test_a_digest_listed_twice_names_its_first_entry() -> None:
    twice = [
        ApiKey(name="first", sha256=digest("sk-shared")),
        ApiKey(name="second", sha256=digest("sk-shared")),
    ]
    assert Authenticator(twice).check("Bearer sk-shared") == "first"


@pytest.mark.parametrize(
    ("authorization", "code"),
    [
        ("Bearer sk-5000", "invalid_api_key"),  # one past the last
        ("Bearer sk-", "invalid_api_key"),
        ("Bearer " + digest("sk-1"), "invalid_api_key"),  # a digest is not its key
        (None, "missing_api_key"),
        ("Basic sk-1", "missing_api_key"),
        ("Bearer   ", "missing_api_key"),
    ],
)
def test_a_wrong_or_missing_key_is_a_401_that_never_echoes_it(
    authorization: str | None, code: str
) -> None:
    auth = Authenticator(_keys(5_000))
    with pytest.raises(GatewayError) as e:
        auth.check(authorization)
    assert e.value.status == 401 and e.value.code == code
    assert "sk-" not in str(e.value)


def test_without_keys_every_client_is_anonymous() -> None:
    auth = Authenticator([])
    assert not auth.enabled
    assert auth.check(None) == auth.check("Bearer anything") == ANONYMOUS
