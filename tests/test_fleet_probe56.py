"""Found at stop 56 (fleet, admin, debug and server leftovers): each test names what a user
hit before its fix."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import httpx
import pytest

from calexec.drivers.serving import byte_tokenizer
from calexec.drivers.serving.server import create_app
from calexec.drivers.serving.service import MAX_CHOICES, ServerConfig
from test_server_support import openai_server, started_executor, through_ingress
from thread_starts import recording_thread_starts


def test_serve_refuses_a_max_choices_past_its_bound_naming_flag_value_and_range():
    """``serve --max-choices 100000000000`` was taken: one request with a huge ``n`` then set
    up that many choices (an admission, a task, a held answer each) and exhausted memory.
    Refused now in one line naming the flag, the value and the range (exit 2)."""
    proc = subprocess.run([sys.executable, "-m", "calexec", "serve", "--once",
                           "--max-choices", str(10 ** 11)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "--max-choices" in proc.stderr and str(10 ** 11) in proc.stderr
    assert f"1..{MAX_CHOICES}" in proc.stderr


def test_a_server_config_refuses_a_max_choices_past_its_bound():
    """The embedder's way to the same cap (``ServerConfig``, a Ray replica's settings)."""
    with pytest.raises(ValueError, match=rf"^max_choices={10 ** 11}: must be .*<= "
                                         rf"{MAX_CHOICES}"):
        ServerConfig(max_choices=10 ** 11)
    assert ServerConfig(max_choices=MAX_CHOICES).max_choices == MAX_CHOICES  # (the bound)


@pytest.mark.parametrize("with_tokenizer", [False, True], ids=["byte-level", "tokenizer-json"])
def test_detokenize_refuses_an_id_outside_the_vocabulary_with_either_tokenizer(
        tmp_path, with_tokenizer):
    """``POST /detokenize {"tokens": [..., 200000]}`` (the synthetic model's vocabulary is
    151,936 ids): with a ``--tokenizer`` the id was dropped silently (200 and a text missing a
    piece), with the byte-level tokenizer it printed ``<200000>``: the same ids read two
    ways, neither saying the id is no token. Both are a 400 naming ``tokens``, the id and the
    vocabulary now, as the id in a prompt is; an id inside it decodes as before."""
    config = ServerConfig()
    good = byte_tokenizer.encode("hi")
    if with_tokenizer:
        tokenizers = pytest.importorskip("tokenizers")
        from tokenizers import models, pre_tokenizers
        tok = tokenizers.Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 5}, unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        tok.save(str(tmp_path / "tokenizer.json"))
        config, good = ServerConfig(tokenizer_path=str(tmp_path / "tokenizer.json")), [5]
    with openai_server(tmp_path, config) as (server, _, service):
        vocab = service.contracts.vocab_size
        answer = httpx.post(f"{server.url}/detokenize", json={"tokens": [*good, 200000]},
                            timeout=30)
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error["param"] == "tokens", error
        assert error["message"] == (f"tokens[{len(good)}]=200000 outside the vocabulary "
                                    f"[0, {vocab})"), error
        edge = httpx.post(f"{server.url}/detokenize", json={"tokens": [vocab]}, timeout=30)
        assert edge.status_code == 400 and "tokens[0]=" in edge.json()["error"]["message"]
        fine = httpx.post(f"{server.url}/detokenize", json={"tokens": good}, timeout=30)
        assert fine.status_code == 200
        assert fine.json()["prompt"] == ("hello" if with_tokenizer else "hi")


# ---- the fleet ingress and a request of several choices --------------------------------------
@pytest.fixture(scope="module")
def replica_app(tmp_path_factory):
    """One server app, every replica of the fleet (each call is a replica of its own)."""
    executor = started_executor(tmp_path_factory.mktemp("fleet56"))
    try:
        yield create_app(executor, ServerConfig())
    finally:
        executor.shutdown(5.0)


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 4, "n": 2}),
    ("/v1/completions", {"prompt": [[1, 2], [3, 4]], "max_tokens": 4}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "max_tokens": 3, "n": 2}),
], ids=["n2", "prompt-list", "chat-n2"])
def test_a_started_stream_of_several_choices_is_not_run_again_on_a_sibling(replica_app, path,
                                                                           body):
    """A streamed request of several choices through the fleet ingress whose replica died
    after a few chunks: the ingress continued it on a sibling with no resume state (such a
    request reports none), the sibling ran it from its start, and the client got the first
    chunks twice, the second time under another id, then two ``[DONE]``-less halves glued
    into one stream with one ``[DONE]``. It ends now with the SSE error event saying why,
    as on a single server; no sibling is called. (Since stop 57 a replica reports progress
    for such a request and the sibling finishes it, tests/test_server_probe57.py; a replica
    that reports none, as here, still cannot be continued.)"""
    content, calls = through_ingress(replica_app, path, {**body, "stream": True}, 3,
                                     progress=False)
    events = [part for part in content.decode().split("\n\n") if part]
    assert len(calls) == 1, [c.get("resume") for c in calls]
    assert b"[DONE]" not in content
    chunks = [json.loads(e.removeprefix("data: ")) for e in events]
    assert len({c["id"] for c in chunks[:-1]}) == 1 and len(chunks) == 4, events
    error = chunks[-1]["error"]
    assert "several choices" in error["message"] and error["code"] == "lifecycle.unavailable"


def test_a_request_of_several_choices_that_sent_nothing_is_run_whole_on_a_sibling(replica_app):
    """Before its first byte, a request of several choices fails over as any request: run
    whole on the sibling, one answer."""
    content, calls = through_ingress(
        replica_app, "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 4, "n": 2}, 0)
    assert len(calls) == 2
    answer = json.loads(content)
    assert [c["index"] for c in answer["choices"]] == [0, 1]


def test_a_replica_s_settings_refuse_a_gil_switch_interval_past_the_bound():
    """``serve --ray``'s replicas set the interval from ``ReplicaSettings.gil_switch_us``:
    refused past the bound when the settings are built, not wrapped to 0 in each replica."""
    pytest.importorskip("ray")
    from calexec.drivers.fleet.ray_serve import ReplicaSettings
    from calexec.drivers.serving.process import MAX_SWITCH_INTERVAL_US

    with pytest.raises(ValueError, match="gil_switch_us"):
        ReplicaSettings(gil_switch_us=10 ** 21)
    assert ReplicaSettings(gil_switch_us=MAX_SWITCH_INTERVAL_US).gil_switch_us \
        == MAX_SWITCH_INTERVAL_US


def test_a_one_prompt_list_stream_continues_on_a_sibling_as_a_plain_prompt(replica_app):
    """``prompt: ["..."]`` (LangChain's ``OpenAI`` LLM sends its prompt as a one-element
    list) is one choice, but it was served as a request of several choices, which reports no
    progress: through the fleet, a replica dying mid-stream left it with no resume (its first
    chunks sent twice under two ids; since the fix above, an error event). It is served as a
    plain prompt now: the sibling continues it and the client sees one stream, the same as
    the uncut one."""
    body = {"prompt": ["hello"], "max_tokens": 6, "stream": True, "seed": 5,
            "temperature": 1.0}
    whole, _ = through_ingress(replica_app, "/v1/completions", body, 99)  # never dies
    cut, calls = through_ingress(replica_app, "/v1/completions", body, 3)
    assert len(calls) == 2 and calls[1]["resume"]["tokens"], [c.get("resume") for c in calls]
    assert cut.count(b"[DONE]") == 1 and b'"error"' not in cut

    def tokens_and_ids(content: bytes) -> tuple[list[int], set[str]]:
        events = [json.loads(e.removeprefix("data: ")) for e in content.decode().split("\n\n")
                  if e and e != "data: [DONE]"]
        return ([t for e in events for t in e["choices"][0]["token_ids"]],
                {e["id"] for e in events})
    (whole_tokens, _), (cut_tokens, cut_ids) = tokens_and_ids(whole), tokens_and_ids(cut)
    assert cut_tokens == whole_tokens and len(cut_tokens) == 6 and len(cut_ids) == 1


def test_a_replica_whose_constructor_fails_past_the_executor_start_shuts_it_down(
        tmp_path, monkeypatch):
    """``CalexecReplica.__init__`` started its executor (device open, the golden run, its
    threads) and then raised on a later step (here ``serve.get_replica_context()`` outside a
    Serve replica): the executor ran on in the process with its threads and device, and its
    scratch directory stayed in TMPDIR (``__del__`` stops only a replica that was built). It
    is now shut down, the directory removed, and the error raised as before."""
    pytest.importorskip("ray")
    import gc
    import tempfile

    from calexec.drivers.fleet import local_ray
    from calexec.drivers.fleet.ray_serve import CalexecReplica, ReplicaSettings

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(local_ray, "bind_serve_grpc_to_node_ip", lambda: False)
    interval = sys.getswitchinterval()

    stopped: list[bool] = []

    class OutsideRay(CalexecReplica):
        """Ray awaits ``__del__``, its graceful-stop hook, also after a constructor that
        raised; Python's collector calls it as well, and dropped the coroutine unawaited
        (``RuntimeWarning: coroutine 'CalexecReplica.__del__' was never awaited``, printed
        by whichever later test collected). Outside Ray this runs the hook as Ray does: for
        a replica never built it ends at its first step, with nothing to drain."""

        def __del__(self) -> None:
            stop = CalexecReplica.__del__(self)
            try:
                stop.send(None)
            except StopIteration:
                stopped.append(True)
            else:
                stop.close()
                stopped.append(False)

    async def construct() -> None:
        OutsideRay(ReplicaSettings(grace_s=5.0, gil_switch_us=0))

    try:
        with recording_thread_starts() as starts, \
                pytest.raises(Exception, match="get_replica_context") as raised:
            asyncio.run(construct())
    finally:
        sys.setswitchinterval(interval)
    del raised  # its traceback holds the replica
    gc.collect()
    assert stopped == [True]  # the hook ran, once, and had nothing to drain
    # the executor's threads are joined by its shutdown; the app's worker pools' keepers end
    # once their pools are collected (``threads.WorkerPool``), on their own threads: waited
    # for, bounded (an immediate look could find a keeper woken but not yet scheduled)
    import time

    until = time.monotonic() + 30.0
    while True:
        left = [t.name for t in starts.ours()
                if t.is_alive() and t.name.startswith("calexec-")]
        if not left or time.monotonic() > until:
            break
        time.sleep(0.01)
    assert left == [], f"the executor's threads still run: {left}"
    assert list(tmp_path.glob("calexec-replica-*")) == []


@pytest.mark.parametrize("grace_s", [float("inf"), float("nan"), -1.0])
def test_a_replica_s_settings_refuse_a_grace_the_executor_would_refuse(grace_s):
    """``ReplicaSettings.grace_s`` is the replica's ``executor.shutdown(grace=...)``, which
    refuses a negative or non-finite grace (ValueError): refused when the settings are built,
    naming the field, not when a replica is stopped (where the drain would fail instead)."""
    pytest.importorskip("ray")
    from calexec.drivers.fleet.ray_serve import ReplicaSettings

    with pytest.raises(ValueError, match="grace_s"):
        ReplicaSettings(grace_s=grace_s)
    assert ReplicaSettings(grace_s=0.0).grace_s == 0.0
