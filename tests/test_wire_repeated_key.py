"""``wire.repeated_key``'s scan, proven equal to the parse it spares (found at stop 67,
leftovers: docs/traceability.md)."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

import needs

needs.module("fastapi", "server")

from calexec.drivers.serving import wire  # noqa: E402

_KEYS = st.sampled_from(["a", "b", "role", "é", "a b", 'q"', "\\", "x:", ""])
_SPACE = st.sampled_from(["", " ", "\n", "\t ", "\r\n"])


def _spelled(key: str, escape_at: int) -> str:
    """``key`` as a JSON string, its character at ``escape_at`` (if any) as a ``\\u`` escape
    (the same key, another spelling)."""
    text = json.dumps(key, ensure_ascii=False)[1:-1]
    if 0 <= escape_at < len(key) and key[escape_at] not in '"\\':
        chars = [json.dumps(c, ensure_ascii=False)[1:-1] for c in key]
        chars[escape_at] = f"\\u{ord(key[escape_at]):04x}"
        text = "".join(chars)
    return f'"{text}"'


@st.composite
def _json_text(draw: st.DrawFn, depth: int = 0) -> str:
    """A JSON text whose objects may give a key twice (at any depth), with strings that look
    like keys (``"a":`` inside a value), escapes, and whitespace around every token."""
    sp = draw(_SPACE)
    kind = draw(st.sampled_from(["object", "array", "scalar"] if depth < 4 else ["scalar"]))
    if kind == "scalar":
        return sp + draw(st.sampled_from(
            ["1", "-2.5e3", "true", "null", '"v"', '"\\"a\\":1"', '"{\\"a\\": 2}"', '", \\"a\\":"',
             '":"', '"\\\\"', '"x\\u0022:"']))
    items = draw(st.lists(st.integers(0, 2), max_size=5))
    if kind == "array":
        inner = [draw(_json_text(depth + 1)) for _ in items]
        return f"{sp}[{','.join(inner)}{draw(_SPACE)}]"
    pairs = [f"{draw(_SPACE)}{_spelled(draw(_KEYS), draw(st.integers(-1, 3)))}{draw(_SPACE)}:"
             f"{draw(_json_text(depth + 1))}" for _ in items]
    return f"{sp}{{{','.join(pairs)}{draw(_SPACE)}}}"


@settings(derandomize=True, max_examples=500, deadline=None)
@given(text=_json_text(), cut=st.integers(-1, 400))
def test_repeated_key_scan_answers_as_the_parse_does(text, cut):
    """``wire.repeated_key`` parsed every API body a second time (jiter, about 6 ms of the
    event loop at 1 MiB) to look for a key given twice; it now scans the body's string tokens
    once and parses only when some key is written twice or with an escape. Equal to the
    parse (``repeated_key_parsed``) on every generated body, repeated keys at every depth or
    none, whole or cut short (invalid JSON)."""
    raw = text.encode()
    if cut >= 0:
        raw = raw[:cut]
    assert wire.repeated_key(raw, scan_from=0) == wire.repeated_key_parsed(raw)


def test_the_generator_gives_bodies_with_and_without_repeated_keys():
    """(the differential test above sees both answers, at depth 0 and deeper)"""
    seen = set()

    @settings(derandomize=True, max_examples=300, deadline=None)
    @given(text=_json_text())
    def collect(text):
        found = wire.repeated_key_parsed(text.encode())
        seen.add(None if found is None else found[1].count(".") > 0)

    collect()
    assert seen == {None, False, True}


def test_a_large_body_without_repeated_keys_is_not_parsed_again(monkeypatch):
    """A 1 MiB body whose keys are each written once is answered by the scan alone; one
    with a key twice is parsed."""
    calls = []
    monkeypatch.setattr(wire, "repeated_key_parsed", lambda raw: calls.append(raw))
    body = json.dumps({"model": "m", "prompt": list(range(150_000)), "max_tokens": 4,
                       "suffix": "x, \"a\": " * 50 + "y" * 100_000, "stop": ["a", "b"],
                       "logit_bias": {str(i): 1 for i in range(300)}})
    assert wire.repeated_key(body.encode()) is None and calls == []
    twice = body[:-1] + ', "max_tokens": 5}'
    wire.repeated_key(twice.encode())
    assert len(calls) == 1
