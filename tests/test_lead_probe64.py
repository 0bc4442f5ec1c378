"""Small operator-facing wording found at stop 64 (the lead's own rows)."""
from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace
from typing import Any, cast

from calexec.drivers.serving.service import sequence_ids_problem


def _executor(max_seqs: int) -> Any:
    return cast(Any, SimpleNamespace(kv=SimpleNamespace(max_seqs=max_seqs)))


def test_a_max_sequences_one_past_the_device_names_one_id_not_a_range_of_one() -> None:
    """``--max-sequences 64`` on a KvManager of 64 ids said "requests on ids 64..64"."""
    said = sequence_ids_problem(_executor(64), 64)
    assert said is not None and "requests on id 64 would be refused" in said, said
    assert "64..64" not in said, said
    said = sequence_ids_problem(_executor(3), 6)
    assert said is not None and "requests on ids 3..6 would be refused" in said, said
    assert sequence_ids_problem(_executor(64), 63) is None


def test_serve_help_names_every_route_the_api_key_leaves_open() -> None:
    """``serve --help`` said only /health, /ready, /metrics stay open under --api-key; /ping,
    /version and /debug/* do too (docs/server.md "API key"), and /tokenizer_info is guarded."""
    out = subprocess.run([sys.executable, "-m", "calexec.cli", "serve", "--help"],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    text = " ".join(out.split())
    for route in ("/tokenizer_info", "/ping", "/version", "/debug/*", "/admin/*"):
        assert route in text, route
