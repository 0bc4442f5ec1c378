"""Known defects left by earlier stops, fixed at stop 68 (docs/traceability.md, "Found at stop
68 (leftovers)")."""

from __future__ import annotations

import json
import re

import pytest

from calexec import __version__
from test_server_support import (
    oracle_tokens,
    send_raw,
    serve_like_fixture,  # noqa: F401 - the fixture ``serve_like``
    split_head,
    started_executor,
)

TOKEN = "leftovers68-admin-token"
FINGERPRINT = re.compile(r"fp_[0-9a-f]{10}\Z")


def test_system_fingerprint_names_the_served_calbin_and_changes_with_a_reload(tmp_path):
    """``system_fingerprint`` was absent from every completion and chat answer and chunk (the
    OpenAI SDK read None), so a client could not tell two backend configurations apart. Now
    it is ``fp_`` and 10 hex digits of the calexec version, the calbin's sha256 and the
    tokenizer: the same in every answer and chunk of one configuration, another after
    ``/admin/reload`` switched to another calbin."""
    from fastapi.testclient import TestClient

    from calexec.drivers.serving.server import ServerConfig, create_app
    from calexec.drivers.serving.service import system_fingerprint
    from calexec.drivers.synthetic import calbin as cb

    executor = started_executor(tmp_path)
    try:
        app = create_app(executor, ServerConfig(admin_token=TOKEN))
        first = system_fingerprint(__version__, executor.generation.calbin_sha256,
                                   "byte-level", None)
        other_seed = cb.DEFAULT_SEED ^ 0x68
        other = tmp_path / "other.calbin"
        other_sha = cb.write(str(other), cb.default_spec(seed=other_seed))
        executor.goldens[other_sha] = tuple(oracle_tokens(
            list(executor.config.golden_tokens), executor.config.golden_decode_steps + 1,
            other_seed))

        def fingerprints(client) -> set[str | None]:
            seen = set()
            for path, body in (("/v1/completions", {"prompt": [5, 6], "max_tokens": 3}),
                               ("/v1/chat/completions",
                                {"messages": [{"role": "user", "content": "hi"}],
                                 "max_tokens": 3})):
                seen.add(client.post(path, json=body).json().get("system_fingerprint"))
                r = client.post(path, json={**body, "stream": True,
                                            "stream_options": {"include_usage": True}})
                chunks = [line[len("data: "):] for line in r.text.splitlines()
                          if line.startswith("data: {")]
                assert len(chunks) >= 3, r.text
                seen.update(json.loads(chunk).get("system_fingerprint") for chunk in chunks)
            return seen

        with TestClient(app) as client:
            assert fingerprints(client) == {first}
            assert FINGERPRINT.match(first)
            r = client.post("/admin/reload", json={"calbin": str(other)},
                            headers={"Authorization": f"Bearer {TOKEN}"})
            assert r.status_code == 200, r.text
            second = system_fingerprint(__version__, other_sha, "byte-level", None)
            assert second != first and FINGERPRINT.match(second)
            assert fingerprints(client) == {second}
    finally:
        executor.shutdown(5.0)


@pytest.mark.parametrize("changed", ["version", "calbin", "tokenizer", "template"])
def test_system_fingerprint_changes_with_each_thing_that_changes_answers(changed):
    from calexec.drivers.serving.service import system_fingerprint

    base = {"version": "0.1.0", "calbin": "a" * 64, "tokenizer": "byte-level",
            "template": None}
    other = {**base, changed: {"version": "0.1.1", "calbin": "b" * 64,
                               "tokenizer": "/m/tokenizer.json", "template": "{{ x }}"}[changed]}

    def fp(parts):
        return system_fingerprint(parts["version"], parts["calbin"], parts["tokenizer"],
                                  parts["template"])

    assert fp(base) == fp(dict(base)) and fp(base) != fp(other)


@pytest.mark.parametrize(("line", "named"), [
    (b"NoColonHere", 'Invalid header token at header field line 3 (no colon: a field line '
                     'is name: value; a line of one word is not shown: it may be a value '
                     'broken onto a line of its own)'),
    (b"sk-live-secret-0123456789", 'Invalid header token at header field line 3 (no colon: '
     'a field line is name: value; a line of one word is not shown: it may be a value '
     'broken onto a line of its own)'),
    (b"Authorization Bearer sk-secret-token-123456789",
     'Invalid header token at header field line 3 ("Authorization", no colon: a field line '
     'is name: value)'),
    (b"Bad Name: v", 'Invalid header token at header field line 3 ("Bad Name: ...")'),
    (b"X-A: a\x01secret", 'Invalid header value char at header field line 3 ("X-A: ...")'),
    (b"X-\xe9: v", 'Invalid header token at header field line 3 ("X-\\u00e9: ...")'),
    (b"X-" + b"n" * 100 + b" y",
     'Invalid header token at header field line 3 ("X-' + "n" * 38 + '...", no colon: a '
     'field line is name: value)'),
], ids=["no-colon", "value-on-its-own-line", "credential", "space-in-name",
        "control-in-value", "latin-1", "long"])
def test_a_malformed_header_line_is_named_in_the_400(serve_like, line, named):
    """``POST /v1/completions`` with a header block holding a malformed line was refused
    ``Invalid HTTP request received: Invalid header token.``, the parser's reason alone: a
    client sending a dozen fields could not tell which one was wrong. The 400 now names the
    line (counted from the one after the request line) and its name up to the colon, at most
    40 characters, JSON-escaped; never a value, which may be a credential. A line of one word
    and no colon is not shown (stop 68's review): a value broken onto a line of its own
    (``X-Api-Key: part1`` then ``sk-live-...``) was shown whole, in the 400 and the server's
    WARNING line."""
    raw = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Ok: 1\r\n" + line
           + b"\r\nContent-Length: 2\r\n\r\n{}")
    data, how = send_raw(serve_like.port, raw, timeout=30)
    status, headers, rest = split_head(data)
    assert status.startswith(b"HTTP/1.1 400") and how == "eof", (how, data[:300])
    error = json.loads(rest[:int(headers["content-length"])])["error"]
    assert error["code"] == "request.malformed_http"
    assert error["message"] == f"Invalid HTTP request received: {named}.", error
    assert b"secret" not in rest


def test_a_malformed_line_of_a_pipelined_request_names_no_other_requests_line(serve_like):
    """Two requests to the same target in one write, the first with a control character in a
    value: the 400 named a line of the second, well-formed one (``header field line 2
    ("Content-Length: ...")``, the line after the fields the parser delivered for the first),
    sending the client to the wrong line: the request line was looked up from the end of what
    was received. When the target's request line is there more than once, which request the
    parser stopped in is not known: the 400 says the parser's reason alone."""
    first = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-A: a\x01b\r\n"
             b"Content-Length: 2\r\n\r\n{}")
    second = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
              b"X-Ok: 1\r\n\r\n{}")
    data, how = send_raw(serve_like.port, first + second, timeout=30)
    status, headers, rest = split_head(data)
    assert status.startswith(b"HTTP/1.1 400") and how == "eof", (how, data[:300])
    error = json.loads(rest[:int(headers["content-length"])])["error"]
    assert error["message"] == ("Invalid HTTP request received: Invalid header value char."
                                ), error


def _sums_that_hold(snap, pool_size: int | None) -> list[str]:
    """The sums docs/embedding.md says every snapshot keeps (``ExecutorSnapshot``), broken."""
    broken = []
    dispatch = snap["dispatch"]
    if not 0 <= dispatch["auto_armed"] <= dispatch["guesses"]:
        broken.append(f"auto_armed {dispatch['auto_armed']} > guesses {dispatch['guesses']}")
    if min(snap["queued"], snap["inflight"], snap["pending_tokens"]) < 0:
        broken.append("a negative dispatch gauge")
    if snap["slots"] is not None and pool_size is not None and sum(
            snap["slots"].values()) != pool_size:
        broken.append(f"slots {snap['slots']} do not sum to {pool_size}")
    capacity = snap["kv_blocks_capacity"]
    if capacity is not None and not 0 <= snap["kv_blocks_reserved"] <= capacity:
        broken.append(f"kv_blocks_reserved {snap['kv_blocks_reserved']} > {capacity}")
    if snap["kv_sequences"] != sorted(set(snap["kv_sequences"])):
        broken.append(f"kv_sequences {snap['kv_sequences']}")
    return broken


def test_every_snapshot_taken_while_busy_keeps_the_documented_sums(tmp_path):
    """The executor's snapshot is read component by component, each under its own lock:
    which sums hold in every snapshot was not said (a job counted queued and in flight? KV
    blocks over capacity?). docs/embedding.md now says exactly which hold; here 4 request
    threads (seeded prompts and lengths, started together by a barrier) prefill, decode and
    release while another thread takes snapshots until they are done: every snapshot keeps
    every documented sum, and no counter ever goes back."""
    import random
    import threading

    from executor_harness import deadline, decode, prefill, running_job_path, write_calbin

    rng = random.Random(68)
    plans = [([rng.randrange(1, 500) for _ in range(rng.randrange(2, 12))], rng.randrange(3, 9))
             for _ in range(4)]
    with running_job_path(write_calbin(tmp_path), inflight_capacity=2) as ex:
        pool_size = sum(ex.snapshot()["slots"].values())
        start = threading.Barrier(len(plans) + 1, timeout=30)
        done = threading.Event()
        errors: list[str] = []

        def request(seq: int, prompt: list[int], steps: int) -> None:
            try:
                start.wait()
                for _ in range(3):
                    result = ex.enqueue(prefill(seq, prompt)).wait_until(deadline(30))
                    past = len(prompt)
                    for _ in range(steps):
                        result = ex.enqueue(decode(seq, result.argmax, past)).wait_until(
                            deadline(30))
                        past += 1
                    status = ex.release_sequence(seq, 5.0)
                    if not status.ok:
                        errors.append(str(status))
            except Exception as err:  # noqa: BLE001 - reported below
                errors.append(repr(err))

        threads = [threading.Thread(target=request, args=(i, *plan)) for i, plan in
                   enumerate(plans)]
        for thread in threads:
            thread.start()
        watcher = threading.Thread(target=lambda: ([t.join(60) for t in threads], done.set()))
        watcher.start()
        start.wait()
        snaps, broken = 0, []
        last: dict[str, int] = {}
        while not done.is_set() and snaps < 200_000:  # bounded
            snap = ex.snapshot()
            snaps += 1
            broken += _sums_that_hold(snap, pool_size)
            for name in ("submitted", "succeeded", "failed", "cancelled", "quarantined"):
                if snap[name] < last.get(name, 0):
                    broken.append(f"{name} went back from {last[name]} to {snap[name]}")
                last[name] = snap[name]
        watcher.join(60)
        assert not errors, errors
        assert done.is_set() and snaps > 10, snaps
        assert not broken, broken[:5]
        assert last["succeeded"] > 0


def test_the_kv_figures_of_a_snapshot_are_of_one_moment(tmp_path):
    """``kv_blocks_reserved`` was summed after the KV coordinator's lock was released, from
    the sequences' views another thread's reservation or release was changing, so a snapshot
    could pair the sequences holding KV at one moment with the blocks of another: here a
    release lands right as the lock is let go, and the snapshot said sequence 3 held KV with
    0 blocks reserved. Both are now read under the lock."""
    from executor_harness import deadline, prefill, running_job_path, write_calbin

    with running_job_path(write_calbin(tmp_path)) as ex:
        assert ex.enqueue(prefill(3, [5, 6, 7, 8, 9])).wait_until(deadline(30)).argmax >= 0
        kvc = ex.kvc
        view = kvc.seqs[3]
        view.reserved_len = view.committed_len  # (as a reservation leaves it)
        before = ex.snapshot()
        assert before["kv_sequences"] == [3] and before["kv_blocks_reserved"] > 0, before
        real = kvc.admission_mu

        class ReleasedAsItIsLetGo:
            """The coordinator's lock, whose release lets another thread's reset in."""

            def __enter__(self):
                return real.__enter__()

            def __exit__(self, *exc):
                out = real.__exit__(*exc)
                view.reserved_len = 0  # another thread's reset, just after
                return out

        kvc.admission_mu = ReleasedAsItIsLetGo()
        try:
            snap = ex.snapshot()
        finally:
            kvc.admission_mu = real
            view.reserved_len = view.committed_len
        assert (snap["kv_sequences"], snap["kv_blocks_reserved"]) == (
            [3], before["kv_blocks_reserved"])
        assert ex.release_sequence(3, 5.0).ok


CHARTS3 = __import__("pathlib").Path(__file__).parent / "data" / "charts3"


def _charts(*args: str, path: str | None = None):
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [
        str(CHARTS3), os.environ.get("PYTHONPATH", "")]))}
    if path is not None:
        env["PATH"] = path
    return subprocess.run([sys.executable, "-m", "calexec", "charts", *args], cwd=CHARTS3,
                          env=env, capture_output=True, text=True, timeout=120, check=False)


def test_charts_paths_takes_its_bound_on_configurations_from_an_option():
    """``calexec charts paths`` explored at most 5000 configurations of a hierarchical chart,
    a bound no option could change: a chart of 6000 was refused for good. ``--max-configurations
    N`` sets it (default 5000); the refusal names the option; a bound that is no int >= 1 is
    refused naming it (exit 2)."""
    done = _charts("paths", "order_flow:OrderFlow", "--max-configurations", "2")
    assert done.returncode == 2 and done.stdout == "", done
    assert done.stderr.startswith("calexec charts paths: OrderFlow: more than 2 configurations "
                                  "reachable"), done.stderr
    assert "raise the bound: `calexec charts paths --max-configurations N`" in done.stderr
    plain = _charts("paths", "order_flow:OrderFlow", "--json")
    bounded = _charts("paths", "order_flow:OrderFlow", "--json", "--max-configurations", "64")
    assert plain.returncode == bounded.returncode == 0, (plain.stderr, bounded.stderr)
    assert json.loads(plain.stdout) == json.loads(bounded.stdout)
    for bad, said in (("0", "must be >= 1, got 0"), ("x", "'x' is not an integer")):
        done = _charts("paths", "order_flow:OrderFlow", "--max-configurations", bad)
        assert done.returncode == 2 and done.stderr.splitlines() == [
            f"calexec charts paths: error: argument --max-configurations: {said} (see calexec "
            "charts paths --help)"], done.stderr


def test_the_configurations_bound_of_the_library_is_checked_and_kept_per_call():
    from calexec.machines import paths
    from calexec.machines.chartref import load_chart

    chart = load_chart("order_flow:OrderFlow", cwd=str(CHARTS3))
    assert paths.as_data(chart) == paths.as_data(chart, max_configurations=64)
    # a graph explored before under a higher bound is refused past a lower one as well
    with pytest.raises(ValueError, match=r"more than 2 configurations reachable"):
        paths.state_paths(chart, max_configurations=2)
    for bad, error in ((0, ValueError), (True, TypeError), ("9", TypeError)):
        with pytest.raises(error, match=rf"^max_configurations={bad!r}: expected an int >= 1"):
            paths.transition_paths(chart, max_configurations=bad)


def test_charts_draw_takes_its_graphviz_timeout_from_an_option(tmp_path):
    """``calexec charts draw`` gave graphviz's dot 60 s per format, a bound no option could
    change: a chart of hundreds of states that needs longer could not be drawn. ``--timeout S``
    sets it (default 60); past it nothing is written and the error says how to give more; a
    value that is no number of seconds > 0 is refused naming it (exit 2). Here a ``dot`` that
    never answers."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "dot").write_text("#!/bin/sh\nexec /bin/sleep 600\n")
    (bin_dir / "dot").chmod(0o755)
    out = tmp_path / "out"
    done = _charts("draw", "order_flow:OrderFlow", "--out", str(out), "--timeout", "0.5",
                   path=str(bin_dir))
    assert done.returncode == 2 and done.stdout == "" and not out.exists(), done
    assert done.stderr.splitlines() == [
        "calexec charts draw: graphviz's dot could not draw OrderFlow (15 states, 12 "
        "transitions): dot -Tsvg did not finish within 0.5 s (give it more: --timeout 1); "
        "nothing written (`charts paths` and `charts draw --check` need no graphviz)"], done.stderr
    for bad in ("0", "nan", "-1", "1e9"):
        done = _charts("draw", "order_flow:OrderFlow", "--out", str(out), "--timeout", bad)
        assert done.returncode == 2 and done.stderr.splitlines() == [
            "calexec charts draw: error: argument --timeout: must be a number of seconds > 0 "
            f"and at most 1e+06, got {bad!r} (see calexec charts draw --help)"], done.stderr


def test_a_schema_seen_before_is_not_checked_and_compiled_again(monkeypatch):
    """A request of a JSON schema whose grammar was kept (grammar.py, stop 67) still ran the
    schema's checks and llguidance's schema compiles (lenient, the unapplied-keyword check,
    strict) before finding the kept grammar: each request of a 2,000-branch schema paid them
    again. The checked schema's grammar is kept now too (same bounds, same reset): the second
    request compiles nothing; a refused schema is not kept, and is refused in the same words
    again. Equal answers to the plain path: tests/test_grammar_reuse.py (both paths)."""
    import needs

    ll = needs.module("llguidance", "server")
    from calexec.drivers.serving import grammar
    from calexec.drivers.serving.byte_tokenizer import ByteTokenizer

    calls: list[str] = []
    real = ll.LLMatcher

    class Counting:
        def __new__(cls, *args, **kw):
            return real(*args, **kw)

        @staticmethod
        def grammar_from_json_schema(*args, **kw):
            calls.append("compile")
            return real.grammar_from_json_schema(*args, **kw)

        @staticmethod
        def validate_grammar_with_warnings(*args, **kw):
            calls.append("validate")
            return real.validate_grammar_with_warnings(*args, **kw)

        grammar_from_lark = staticmethod(real.grammar_from_lark)

    monkeypatch.setattr(ll, "LLMatcher", Counting)
    grammar.forget_compiled()
    schema = {"type": "object", "properties": {"only_in_probe68": {"type": "integer"}},
              "required": ["only_in_probe68"]}
    rf = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}}
    grammars = []
    for _ in range(2):
        before = len(calls)
        grammars.append(grammar.completion_structure(rf, ByteTokenizer(), 600, 0).grammar)
        calls.append(f"request:{len(calls) - before}")
    assert grammars[0] == grammars[1]
    first, second = (int(c.split(":")[1]) for c in calls if c.startswith("request:"))
    assert first >= 3 and second == 0, calls
    bad = {"type": "json_schema", "json_schema": {"name": "a", "schema": {
        "type": "array", "uniqueItems": True}, "strict": True}}
    refusals = []
    for _ in range(2):
        with pytest.raises(grammar.GrammarError) as err:
            grammar.completion_structure(bad, ByteTokenizer(), 600, 0)
        refusals.append((err.value.param, str(err.value)))
    assert refusals[0] == refusals[1] and "uniqueItems" in refusals[0][1]
