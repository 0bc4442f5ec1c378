"""Stop 72, the lead: what the merge of six probes needed beside their own tests."""

from __future__ import annotations

import pytest

from calexec.contracts.errors import Category
from calexec.contracts.status import Status
from calexec.contracts.types import SHA256_RE


def test_the_digest_pattern_matches_whole_by_match_and_by_fullmatch_alike() -> None:
    """The http probe moved the anchoring of ``SHA256_RE`` into ``fullmatch`` at each of its
    callers; a later caller using ``match`` took a digest followed by anything, a line feed
    included. The pattern itself is anchored now."""
    digest = "ab" * 32
    for look in (SHA256_RE.match, SHA256_RE.fullmatch):
        assert look(digest)
        for bad in (digest + "\n", digest + "0", "\n" + digest, digest[:-1]):
            assert not look(bad), (look, bad)


@pytest.mark.parametrize("code", ["kv.full\n", "kv.full.", ".kv.full", "kv", "KV.full"])
def test_a_status_code_is_taken_only_whole(code: str) -> None:
    """``Status.code`` is ``<domain>.<reason>`` whole: a code ending in a line feed was taken
    (``$`` matched before it) until stop 72."""
    with pytest.raises(ValueError, match="must be 'ok' or '<domain>.<reason>'"):
        Status(code=code, category=Category.TRANSIENT)
