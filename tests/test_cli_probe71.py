"""Stop 71 (cli): bad CLI input and interrupts, as a user on a terminal and a CI script give
them (docs/traceability.md, "Found at stop 71 (cli)"). Never a timing figure.
"""

from __future__ import annotations

import signal
import threading
import time

import pytest

import needs

needs.module("httpx", "server")  # the soak drives the server over HTTP ([server])
from calexec.drivers.tools.bench import soak  # noqa: E402

#: how long a client that finished a request after the interrupt holds it before counting:
#: long enough that a run not waiting for its clients has returned by then (not asserted)
HOLD_S = 2.0


def _clients_alive() -> list[str]:
    return [t.name for t in threading.enumerate()
            if t.name.startswith("bench-soak-client") and t.is_alive()]


def test_an_interrupted_soak_has_ended_its_clients_when_it_returns():
    """``calexec bench soak`` interrupted (Ctrl-C, or a SIGTERM made one) said
    ``interrupted`` and returned with its client threads still running (non-daemon: the
    interpreter waited for them at exit), so a second Ctrl-C in that window printed
    ``Exception ignored in: <module 'threading'> ... KeyboardInterrupt``, a traceback, on the
    terminal. The interrupt path now ends and joins them, as the run's normal end does."""
    interrupted = threading.Event()

    def count(body, tokens):  # (in a client thread, for each request it completed)
        if not interrupted.is_set():
            interrupted.set()  # a Ctrl-C, while this client holds a request it finished
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            time.sleep(HOLD_S)
        return tokens

    assert not _clients_alive()
    with pytest.raises(KeyboardInterrupt):
        soak.run_cli(["bench", "soak", "--json", "--requests", "60", "--faults", "1",
                      "--clients", "2", "--seed", "3", "--max-tokens", "3-4",
                      "--progress-s", "600", "--max-seconds", "120"],
                     soak.Hooks(tokens=count))
    assert interrupted.is_set()
    assert _clients_alive() == []


def _executor_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate()
            if t.name in ("calexec-submitter", "calexec-completion") and t.is_alive()}


def test_an_interrupted_demo_shuts_its_executor_down(capsys):
    """``calexec demo`` interrupted (Ctrl-C, or a SIGTERM made one), or one whose prefill or
    decode failed (``return 1``), never shut its executor down: the device was not drained nor
    released, its submitter and completion threads ran on until the interpreter's exit (every
    other tool shuts down in a ``finally``). It now does on every way out."""
    from calexec import cli

    # (another test of this worker process may have left an executor's threads running:
    # only the ones this demo started are judged)
    before = _executor_threads()
    main = threading.main_thread().ident

    def interrupt_once_decoding() -> None:
        for _ in range(3000):  # (bounded: 30 s)
            if "runtime " in capsys.readouterr().out:  # started: the first line is printed
                signal.pthread_kill(main, signal.SIGINT)
                return
            time.sleep(0.01)

    watcher = threading.Thread(target=interrupt_once_decoding, daemon=True)
    watcher.start()
    code = cli.main(["demo", "--seqs", "2", "--tokens", "40000", "--prompt-len", "4"])
    watcher.join(5)
    assert code == 130
    assert [t.name for t in _executor_threads() - before] == []


def test_a_conform_experiment_timeout_does_not_count_its_child_starting():
    """``calexec conform --timeout 0.5`` (or the default on a busy CI host) had every
    experiment killed while its spawn child was still starting its interpreter and imports,
    each reported ``experiment did not finish within 0.5 s (child killed): the runtime hung``:
    the library was blamed for the host. The timeout now starts once the child runs the
    experiment; an experiment that does not end within it is still killed."""
    from calexec.drivers.tools.conform import isolate

    # (a spawn child takes longer than this to start anywhere: the timeout counted it)
    quick = isolate.run_isolated("textwrap:dedent", {"text": "  x"}, 0.01)
    assert (quick.status, quick.result) == (isolate.OK, "x"), quick
    # (minutes of work: killed at its timeout, as a hung runtime's call is)
    hung = isolate.run_isolated("hashlib:pbkdf2_hmac", {
        "hash_name": "sha256", "password": b"x", "salt": b"y", "iterations": 2 ** 31 - 1}, 0.2)
    assert hung.status == isolate.TIMEOUT and "the runtime hung" in hung.reason, hung
