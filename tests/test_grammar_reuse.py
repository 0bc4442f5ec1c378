"""Each grammar built once (stop 67): a request's grammar was validated with the tokenizer,
built for the check that it admits a value, then built again for each choice of ``n`` (a
2,000-branch ``anyOf`` schema: ~1 s per build); now it is built once, kept across requests
(grammar.KEPT_MAX), and every generation starts from a copy. Proven equal to the plain path
(``grammar.REUSE_COMPILED = False``: each step on its own) on the answers: each choice's
masks and errors along seeded walks, and each refusal's field and message. And a compile the
request abandoned (its timeout passed) stops at its next step instead of holding one of the
server's two compile threads to its end."""

from __future__ import annotations

import json
import random
import socket
import threading
from typing import Any

import httpx
import numpy as np
import pytest

import needs
from calexec.drivers.serving import grammar
from calexec.drivers.serving.byte_tokenizer import ByteTokenizer
from calexec.drivers.serving.server import ServerConfig, create_app
from test_server_support import LiveServer, started_executor

VOCAB = 600
END = 0
MODEL = "calexec-qwen3-synthetic"


@pytest.fixture()
def llguidance():
    return needs.module("llguidance", "server")


def _anyof(k: int) -> dict[str, Any]:
    return {"anyOf": [{"type": "object", "properties": {"kind": {"const": f"k{i}"},
                                                         "n": {"type": "integer", "minimum": i}},
                       "required": ["kind", "n"]} for i in range(k)]}


def _deep(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def _rf(schema: Any, strict: bool | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"name": "answer", "schema": schema}
    if strict is not None:
        spec["strict"] = strict
    return {"type": "json_schema", "json_schema": spec}


CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "integer", "minimum": 0, "maximum": 12}},
    "required": ["zone"]}}}
NOTE = {"type": "function", "function": {"name": "note", "parameters": {
    "type": "object", "properties": {"text": {"type": "string", "maxLength": 8}},
    "required": ["text"]}}}

#: response_format cases: valid ones, and ones refused (each a 400 naming its field)
FORMATS: list[tuple[str, Any]] = [
    ("json_object", {"type": "json_object"}),
    ("small", _rf({"type": "object", "properties": {"x": {"type": "integer"}},
                   "required": ["x"]})),
    ("anyOf40", _rf(_anyof(40))),
    ("deep30", _rf(_deep(30))),
    ("enum", _rf({"enum": ["red", "green", 3, None]})),
    ("self_ref", _rf({"$ref": "#"})),  # no JSON value satisfies it
    ("bad_pointer", _rf({"type": "object", "properties": {"a": {"$ref": "#/$defs/nope"}}})),
    ("unsatisfiable", _rf({"type": "object", "properties": {"a": {"type": "integer"}},
                           "required": ["a", "c"], "additionalProperties": False})),
    ("unapplied", _rf({"type": "array", "uniqueItems": True}, strict=True)),
    ("not_object", _rf(["not", "a", "schema"])),
]

#: chat cases: (tools, tool_choice, response_format)
CHATS: list[tuple[str, Any, Any, Any]] = [
    ("auto", [CLOCK, NOTE], "auto", None),
    ("required", [CLOCK, NOTE], "required", None),
    ("named", [CLOCK, NOTE], {"type": "function", "function": {"name": "note"}}, None),
    ("auto_with_format", [CLOCK], "auto", FORMATS[1][1]),
    ("bad_tool", [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/nope"}}}}}], "auto", None),
]


def _walk(structure: grammar.Structure, seeds: list[int], steps: int = 40) -> list[Any]:
    """n choices started from ``structure`` and advanced together, interleaved (a copy shares
    nothing with its siblings): each step's allowed tokens and the error, per choice."""
    states = [structure.start() for _ in seeds]
    rngs = [random.Random(seed) for seed in seeds]
    trace: list[Any] = [[] for _ in seeds]
    done = [False] * len(seeds)
    for _ in range(steps):
        for i, state in enumerate(states):
            if done[i]:
                continue
            mask = state.allowed()
            allowed = np.flatnonzero(mask)
            trace[i].append(allowed.tolist())
            if state.finished or not allowed.size:
                done[i] = True
                continue
            token = int(rngs[i].choice(allowed.tolist()))
            if token == END:
                done[i] = True
                continue
            state.accept(token)
            trace[i].append(state.error)
    return trace


def _answer(build: Any, *args: Any) -> Any:
    """What a request gets from ``build``: its refusal (field, message) or its choices."""
    try:
        structure = build(*args, ByteTokenizer(), VOCAB, END)
    except grammar.GrammarError as err:
        return ("refused", err.param, str(err))
    if structure is None:
        return None
    return ("served", structure.grammar, structure.finite, _walk(structure, [1, 2, 3]))


def _both(monkeypatch, build: Any, *args: Any) -> tuple[Any, Any, Any]:
    monkeypatch.setattr(grammar, "REUSE_COMPILED", False)
    plain = _answer(build, *args)
    monkeypatch.setattr(grammar, "REUSE_COMPILED", True)
    grammar.forget_compiled()
    first = _answer(build, *args)  # built once
    again = _answer(build, *args)  # from the kept grammars
    return plain, first, again


@pytest.mark.parametrize("name,response_format", FORMATS, ids=[f[0] for f in FORMATS])
def test_a_reused_grammar_answers_as_the_plain_path(llguidance, monkeypatch, name,
                                                    response_format):
    plain, first, again = _both(monkeypatch, grammar.completion_structure, response_format)
    assert first == plain
    assert again == plain
    if name in ("self_ref", "bad_pointer", "unsatisfiable", "unapplied", "not_object"):
        assert plain[0] == "refused", plain  # (the corpus holds refusals, as it says)
    else:
        assert plain[0] == "served", plain


@pytest.mark.parametrize("name,tools,choice,response_format", CHATS, ids=[c[0] for c in CHATS])
def test_a_reused_tools_grammar_answers_as_the_plain_path(llguidance, monkeypatch, name, tools,
                                                          choice, response_format):
    setup = grammar.tool_setup(tools, choice)
    plain, first, again = _both(monkeypatch, grammar.chat_structure, response_format, setup,
                                None)
    assert first == plain
    assert again == plain
    assert plain[0] == ("refused" if name == "bad_tool" else "served"), plain


def test_each_grammar_is_built_once_per_request_and_its_choices_are_copies(llguidance,
                                                                          monkeypatch):
    """A 40-branch schema (a property name no other test uses: nothing kept), three choices:
    one build of its grammar, none for the choices, none for the same schema's next request.
    Until stop 67: built for the check, then again for each choice (4), and all over again
    for the next request."""
    import llguidance as ll
    built: list[str] = []
    real = ll.LLMatcher

    class Counting:
        def __new__(cls, tokenizer: Any, text: str, **kw: Any) -> Any:
            built.append(text)
            return real(tokenizer, text, **kw)
        validate_grammar_with_warnings = staticmethod(real.validate_grammar_with_warnings)
        grammar_from_json_schema = staticmethod(real.grammar_from_json_schema)
        grammar_from_lark = staticmethod(real.grammar_from_lark)

    monkeypatch.setattr(ll, "LLMatcher", Counting)
    schema = _anyof(40)
    schema["anyOf"][0]["properties"]["only_in_the_build_count_test"] = {"type": "boolean"}
    grammars = []
    for _ in range(2):  # the second request: from the kept grammar
        structure = grammar.completion_structure(_rf(schema), ByteTokenizer(), VOCAB, END)
        _walk(structure, [1, 2, 3], steps=2)
        grammars.append(structure.grammar)
    assert grammars[0] == grammars[1]
    assert built.count(structure.grammar) == 1


def test_the_kept_grammars_are_bounded(llguidance, monkeypatch):
    """At most KEPT_MAX grammars are kept: the least recently used goes first."""
    monkeypatch.setattr(grammar, "KEPT_MAX", 2)
    grammar.forget_compiled()
    made = []
    for k in range(4):
        made.append(grammar.completion_structure(
            _rf({"type": "object", "properties": {f"p{k}": {"type": "integer"}}}),
            ByteTokenizer(), VOCAB, END))
    again = grammar.completion_structure(
        _rf({"type": "object", "properties": {"p3": {"type": "integer"}}}),
        ByteTokenizer(), VOCAB, END)
    assert again.matcher is made[3].matcher  # kept (the mirror and p3's grammar: two)
    first = grammar.completion_structure(
        _rf({"type": "object", "properties": {"p0": {"type": "integer"}}}),
        ByteTokenizer(), VOCAB, END)
    assert first.matcher is not made[0].matcher  # dropped, built again
    grammar.forget_compiled()


def test_a_compile_whose_timeout_passed_stops_at_its_next_step(llguidance, monkeypatch,
                                                              tmp_path):
    """A stand-in first step blocks until the request's checkpoint is stopped (its timeout
    passing sets it); the compile then stops at its next step, a 504 naming ``timeout``,
    and the thread is free: the next grammar request is served. Until stop 67 nothing
    stopped an abandoned compile: it held its compile thread to its end."""
    seen: list[Any] = []
    real_build = grammar.completion_structure
    real_schema = grammar.response_format_schema
    blocked = threading.Event()

    def recording(response_format: Any, tok: Any, vocab: int, end: int,
                  check: Any = None) -> Any:
        seen.append(check)
        if check is None:  # (the server gave no checkpoint)
            return real_build(response_format, tok, vocab, end)
        return real_build(response_format, tok, vocab, end, check)

    def stand_in(response_format: Any) -> Any:
        if response_format.get("json_schema", {}).get("name") == "slow":
            blocked.set()
            assert seen[-1].stopped.wait(30), "the checkpoint was never stopped"
        return real_schema(response_format)

    executor = started_executor(tmp_path)
    try:
        app = create_app(executor, ServerConfig())
        monkeypatch.setattr(grammar, "completion_structure", recording)
        monkeypatch.setattr(grammar, "response_format_schema", stand_in)
        with LiveServer(app) as server:
            slow = {"type": "json_schema", "json_schema": {"name": "slow", "schema": {
                "type": "object"}}}
            r = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
                "model": MODEL, "prompt": "x", "max_tokens": 4, "timeout": 0.2,
                "response_format": slow})
            assert blocked.is_set()
            assert r.status_code == 504, r.text
            error = r.json()["error"]
            assert error["param"] == "timeout"
            assert "passed while its grammar compiled" in error["message"], error["message"]
            assert seen[-1].why == "timeout"
            ok = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
                "model": MODEL, "prompt": "x", "max_tokens": 4,
                "response_format": {"type": "json_object"}})
            assert ok.status_code == 200, ok.text
    finally:
        executor.shutdown(5.0)


def test_a_compile_whose_client_left_stops_at_its_next_step(llguidance, monkeypatch, tmp_path):
    """The client closes its connection while the stand-in first step blocks: the
    disconnect stops the checkpoint, the compile stops at its next step (grammar.Abandoned)
    instead of running to its end in one of the two compile threads."""
    seen: list[Any] = []
    ended: list[BaseException] = []
    finished = threading.Event()
    blocked = threading.Event()
    real_build = grammar.completion_structure
    real_schema = grammar.response_format_schema

    def recording(response_format: Any, tok: Any, vocab: int, end: int,
                  check: Any = None) -> Any:
        seen.append(check)
        try:
            if check is None:
                return real_build(response_format, tok, vocab, end)
            return real_build(response_format, tok, vocab, end, check)
        except BaseException as err:
            ended.append(err)
            raise
        finally:
            finished.set()

    def stand_in(response_format: Any) -> Any:
        blocked.set()
        assert seen[-1].stopped.wait(30), "the checkpoint was never stopped"
        return real_schema(response_format)

    executor = started_executor(tmp_path)
    try:
        app = create_app(executor, ServerConfig())
        monkeypatch.setattr(grammar, "completion_structure", recording)
        monkeypatch.setattr(grammar, "response_format_schema", stand_in)
        with LiveServer(app) as server:
            host, port = server.url.split("//")[1].split(":")
            body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 4, "timeout": 600,
                               "response_format": {"type": "json_object"}}).encode()
            with socket.create_connection((host, int(port)), timeout=30) as conn:
                conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                             b"Content-Type: application/json\r\n"
                             b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n"
                             + body)
                assert blocked.wait(30)
            assert finished.wait(30)
            assert seen[-1].why == "cancelled"
            assert len(ended) == 1 and isinstance(ended[0], grammar.Abandoned), ended
    finally:
        executor.shutdown(5.0)
