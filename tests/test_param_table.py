"""docs/server.md's request-parameter table is what the tests prove (issue 27,
``calexec.drivers.tools.param_table``): its last column, the tests that send each field, is
current; every field of the pinned ``openai`` SDK's completion and chat request types has a
row; every field the table names is sent by some test; and the scanner finds what a test
sends (SDK keywords, JSON bodies, parametrized field names), not the client's own options."""

from __future__ import annotations

import typing
from pathlib import Path

from openai.types import completion_create_params as completion_params
from openai.types.chat import completion_create_params as chat_params

from calexec.drivers.tools import param_table

ROOT = Path(__file__).resolve().parent.parent
DOC = (ROOT / "docs" / "server.md").read_text(encoding="utf-8")


def test_the_table_is_current():
    fresh = param_table.render(DOC, ROOT / "tests")
    assert fresh == DOC, ("docs/server.md's parameter table is stale: run "
                          "python -m calexec.drivers.tools.param_table")


def test_every_sdk_request_field_has_a_row():
    sdk = set(typing.get_type_hints(completion_params.CompletionCreateParamsNonStreaming)) | \
        set(typing.get_type_hints(chat_params.CompletionCreateParamsNonStreaming))
    missing = sorted(sdk - param_table.documented_fields(DOC))
    assert not missing, f"fields of the openai SDK's request types with no row: {missing}"


def test_every_field_of_the_table_is_sent_by_a_test():
    fields = param_table.documented_fields(DOC)
    sending = param_table.tests_sending(ROOT / "tests", fields)
    unsent = sorted(field for field, tests in sending.items() if not tests)
    assert not unsent, f"fields no test sends: {unsent}"


def test_the_scanner_reads_what_a_test_sends(tmp_path):
    (tmp_path / "test_sample.py").write_text('''
import pytest
FIELDS = [("logit_bias", {}), ("min_p", 0.5)]

def test_sdk(client):
    client.completions.create(model="m", prompt="x", seed=1, timeout=5,
                              extra_body={"top_k": 3})

def test_body(http):
    http.post("/v1/chat/completions", json={"messages": [], "n": 2})

@pytest.mark.parametrize(("field", "value"), FIELDS)
def test_fields(field, value):
    pass

def test_client_options_only(ChatOpenAI):
    ChatOpenAI(timeout=3, max_retries=0, temperature=0)
''')
    fields = {"model", "prompt", "seed", "timeout", "top_k", "messages", "n", "logit_bias",
              "min_p", "temperature", "stop"}
    sent = param_table.tests_sending(tmp_path, fields)
    assert sent["seed"] == sent["prompt"] == ["test_sample.py::test_sdk"]
    assert sent["top_k"] == ["test_sample.py::test_sdk"]
    assert sent["n"] == sent["messages"] == ["test_sample.py::test_body"]
    assert sent["logit_bias"] == sent["min_p"] == ["test_sample.py::test_fields"]
    assert sent["temperature"] == ["test_sample.py::test_client_options_only"]
    assert sent["timeout"] == [] and sent["stop"] == []  # client options and absent fields


def test_check_says_stale_and_write_fixes_it(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_one.py").write_text(
        'def test_seeded(client):\n    client.completions.create(prompt="x", seed=1)\n')
    doc = tmp_path / "docs" / "server.md"
    doc.write_text(DOC, encoding="utf-8")  # the repository's tests, not this one's
    assert param_table.main(["--root", str(tmp_path), "--check"]) == 1
    assert doc.read_text(encoding="utf-8") == DOC  # --check writes nothing
    assert param_table.main(["--root", str(tmp_path)]) == 0
    assert param_table.main(["--root", str(tmp_path), "--check"]) == 0
    assert "| 1: `test_one.py::test_seeded` |" in doc.read_text(encoding="utf-8")


def test_a_row_given_twice_is_refused_naming_both(tmp_path, capsys):
    """docs/server.md carried the ``model``, ``prompt``, ``messages`` and ``max_tokens`` rows
    twice (since a regeneration at stop 53), and the check took it: a reader met each rule
    twice, any later edit of one copy would leave the other saying something else. A row
    given twice is now refused, naming both, and the table has each once."""
    lines = DOC.split("\n")
    start, _ = param_table.table_span(lines)
    assert param_table.render(DOC, ROOT / "tests") == DOC  # each row once
    twice = "\n".join(lines[:start + 3] + [lines[start + 2]] + lines[start + 3:])
    (tmp_path / "docs").mkdir()
    (tmp_path / "tests").mkdir()
    (tmp_path / "docs" / "server.md").write_text(twice, encoding="utf-8")
    assert param_table.main(["--root", str(tmp_path), "--check"]) == 2
    err = capsys.readouterr().err
    assert "rows 1 and 2 are the same row (| `model` | both |" in err, err
