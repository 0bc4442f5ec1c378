"""Threaded fault soak of the reference server (issue 13), through ``calexec.drivers.tools.chaos``:
~16 concurrent loopback clients (plain and streaming completions, early disconnects, short
timeouts) while a seeded schedule injects every job-level emulator fault kind, hung jobs, good
and refused reloads (and a reload whose new generation cannot map its buffers), then drains.
What is asserted is listed in drivers/tools/chaos.py: 0 wrong tokens against the oracle, 0 responses
later than deadline + slack, only documented statuses with JSON bodies or SSE error events,
free + in-use + withheld sequence ids = capacity, nothing leased when idle, /ready 200 after
each fault within the recovery bound, the drain ending Stopped.

Size (the default is a few seconds, for the suite); a longer run is one command, either

    CALEXEC_CHAOS_SECONDS=120 CALEXEC_CHAOS_CLIENTS=16 CALEXEC_CHAOS_SEED=7 \\
        python -m pytest -q -s tests/test_chaos.py

(``CALEXEC_CHAOS_ACTIONS=hang,reload_good`` restricts the schedule) or
``calexec accept --gates chaos --chaos-seconds 600`` (both phases, a report). The run's
figures are printed (``-s``) as one ``chaos:`` JSON line.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("httpx", reason="the chaos soak drives the server over HTTP ([server])")
from calexec.drivers.tools import chaos  # noqa: E402
from test_server_support import wait_for  # noqa: E402

SECONDS = float(os.environ.get("CALEXEC_CHAOS_SECONDS", "6"))
CLIENTS = int(os.environ.get("CALEXEC_CHAOS_CLIENTS", "16"))
SEED = int(os.environ.get("CALEXEC_CHAOS_SEED", "13"))
ACTIONS = tuple(a for a in os.environ.get("CALEXEC_CHAOS_ACTIONS", "").split(",") if a) \
    or chaos.ACTIONS


def test_chaos_soak_under_faults_reloads_and_hangs(tmp_path):
    figures = chaos.run_chaos(tmp_path, SECONDS, CLIENTS, SEED, ACTIONS)
    problems, wrong = figures.pop("problems"), figures.pop("wrong")
    print("chaos:", json.dumps({**figures, "problems": len(problems)}, sort_keys=True))
    assert not wrong, wrong[:10]
    assert not problems, problems[:10]
    assert figures["requests"] > 0 and figures["schedule_steps"] >= 1
    counts = figures["idle"]["sequences"]
    assert counts["free"] == counts["capacity"] and counts["withheld"] == 0
    assert figures["final_ready"] == 200 and figures["lifecycle"] == "Stopped"


def test_an_unknown_action_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="unknown chaos action.*'no_such_fault'"):
        chaos.run_chaos(tmp_path, 1, 1, 1, ("no_such_fault",))


def _late_record(client_s: float, timeout: float = 0.085) -> chaos.Record:
    rec = chaos.Record("short", [1, 2, 3], 2, timeout)
    rec.start, rec.end, rec.code = 100.0, 100.0 + client_s, 200
    rec.body = {"choices": [{"token_ids": list(chaos.oracle_tokens((1, 2, 3), 2)),
                              "finish_reason": "length"}]}
    return rec


def test_a_late_answer_is_judged_by_the_servers_clock_when_the_server_recorded_it():
    """chaos_a once failed on a loaded host: "answered 1.585s after its 0.085s deadline
    (server-side 0.15773s; slack 0.5s)", the server within deadline + slack and the client,
    in the same process, scheduled late. The server's record judges (no clock read here:
    the record's times are given)."""
    problems: list[str] = []
    chaos.check_record(_late_record(1.67), 0.5, 0.158, problems, [])
    assert problems == []
    chaos.check_record(_late_record(0.2), 0.5, 0.6, problems, [])  # the server itself late
    assert len(problems) == 1 and "server-side 0.6s" in problems[0], problems
    # no server record: the client's clock, with the harness's allowance
    late = 0.085 + 0.5 + chaos.HARNESS_ALLOWANCE_S + 0.1
    chaos.check_record(_late_record(late), 0.5, None,
                 problems, [])
    assert len(problems) == 2, problems


def test_an_answer_late_by_no_more_than_the_loops_lag_is_not_the_servers_fault():
    """chaos_a failed in CI: an answer 0.3-0.85 s past deadline + slack by the server's own
    record, while its deadline had fired on time: the event loop of a CPU-starved host ran
    what it was handed that late (stop 69). A late answer is held to deadline + slack + the
    loop's lag meanwhile; lateness beyond that lag still fails."""
    problems: list[str] = []
    server_s = 0.085 + 0.5 + 0.3  # 0.3 s past deadline + slack, by the server's record
    chaos.check_record(_late_record(server_s), 0.5, server_s, problems, [], loop_lag_s=0.35)
    assert problems == []
    chaos.check_record(_late_record(server_s), 0.5, server_s, problems, [], loop_lag_s=0.2)
    assert len(problems) == 1 and "the event loop ran 0.200s late" in problems[0], problems


def _held_loop(hold_with_a_wait: bool) -> tuple[list, float, float, chaos.LoopLag]:
    """A loop held by one callback, the probe handing it callbacks meanwhile (at least 3):
    the callback either waits on the loop's thread (``Event.wait``: a blocking call on the
    loop, a server's defect) or keeps it busy (the shape of a host that gives it no CPU).
    (the probes handed while held, from, to, the probe)."""
    loop = asyncio.new_event_loop()
    runner = threading.Thread(target=loop.run_forever, name="test-loop", daemon=True)
    runner.start()
    entered, release = threading.Event(), threading.Event()

    def hold() -> None:
        entered.set()
        if hold_with_a_wait:
            release.wait(10)
        else:
            end = time.monotonic() + 10
            while not release.is_set() and time.monotonic() < end:
                pass
    try:
        with chaos.LoopLag(loop, every_s=0.002) as lag:
            wait_for(lambda: bool(lag.samples), timeout=10, what="the probe's first callback")
            loop.call_soon_threadsafe(hold)
            assert entered.wait(10)
            held_from = time.monotonic()
            handed = lag.handed
            deadline = time.monotonic() + 10
            while lag.handed < handed + 3 and time.monotonic() < deadline:
                time.sleep(0.001)
            released_at = time.monotonic()
            release.set()
            handed = lag.handed  # (each of them handed to the loop already: they run in order)
            wait_for(lambda: len(lag.samples) >= handed, timeout=10,
                     what="every probe handed while the loop was held to run")
        held = [(h, late) for h, late in lag.samples if held_from <= h <= released_at]
        return held, held_from, released_at, lag
    finally:
        release.set()
        loop.call_soon_threadsafe(loop.stop)
        runner.join(10)
        loop.close()


def test_the_loop_lag_probe_measures_a_loop_that_could_not_run():
    """``LoopLag`` on a loop kept busy by one callback: every probe handed meanwhile ran no
    sooner than the loop was let go, and a window with no probe is 0."""
    held, held_from, released_at, lag = _held_loop(hold_with_a_wait=False)
    assert len(held) >= 2, lag.samples
    assert all(late >= released_at - h for h, late in held), held
    assert lag.blocked == [], lag.blocked
    assert lag.worst(held_from, released_at) == max(late for _, late in held)
    assert lag.worst(-2.0, -1.0) == 0.0


def test_a_loop_blocked_on_its_own_thread_excuses_no_late_answer():
    """A blocking wait on the event loop's thread makes every callback handed meanwhile late
    as a starved host does, and an answer it held up late past deadline + slack was excused
    by that lag (stop 69's ``LoopLag``): a server that waits on its loop passed the soak. The
    probe looks at the loop thread's stack while a callback is late: found in a blocking
    wait (here ``Event.wait`` in this test's callback), the lag across it excuses nothing."""
    held, held_from, released_at, lag = _held_loop(hold_with_a_wait=True)
    assert len(held) >= 2, lag.samples
    assert all(late >= released_at - h for h, late in held), held
    assert lag.worst(held_from, released_at) == 0.0, (lag.blocked, held)
    assert lag.blocked and all("in hold (waits in threading.wait)" in where
                               for _, where in lag.blocked), lag.blocked
    problems: list[str] = []
    server_s = 0.085 + 0.5 + 0.3
    chaos.check_record(_late_record(server_s), 0.5, server_s, problems, [],
                       loop_lag_s=lag.worst(held_from, released_at))
    assert len(problems) == 1, problems



def _stack(*calls: tuple[str, str]) -> SimpleNamespace:
    """A stack as ``sys._current_frames`` gives it (the innermost frame, ``f_back`` to the
    outermost) of ``calls``, outermost first: (file, function)."""
    frame = None
    for line, (file, name) in enumerate(calls, start=1):
        frame = SimpleNamespace(f_code=SimpleNamespace(co_filename=file, co_name=name),
                                f_lineno=line, f_back=frame)
    return frame


def test_a_loop_waiting_for_a_new_thread_to_start_is_not_blocked():
    """``Thread.start`` waits for the new thread to run once (anyio starts its worker threads
    on the loop, the service its background releases; the soak found the loop there): a
    wait for the host's scheduler, not for other work, so ``blocking_wait`` does not name
    it. An ``Event.wait`` or a ``Thread.join`` it names with its caller; a loop in its
    selector is idle."""
    threading_py = "/usr/lib/python3.11/threading.py"
    base = ("/srv/base_events.py", "_run_once")
    start = _stack(base, ("/srv/anyio.py", "run_sync_in_worker_thread"),
                   (threading_py, "start"), (threading_py, "wait"), (threading_py, "wait"))
    assert chaos.blocking_wait(start) is None
    waiting = _stack(base, ("/srv/service.py", "_take_last"), ("/srv/job.py", "wait_until"),
                     (threading_py, "wait"), (threading_py, "wait"))
    assert chaos.blocking_wait(waiting) == "/srv/job.py:3 in wait_until (waits in threading.wait)"
    joining = _stack(base, ("/srv/service.py", "finish"), (threading_py, "join"),
                     (threading_py, "_wait_for_tstate_lock"))
    assert chaos.blocking_wait(joining) == \
        "/srv/service.py:2 in finish (waits in threading._wait_for_tstate_lock)"
    idle = _stack(base, ("/usr/lib/python3.11/selectors.py", "select"))
    assert chaos.blocking_wait(idle) is None
    assert chaos.blocking_wait(None) is None


def test_a_chaos_client_that_dies_is_reported_not_lost():
    """A client thread of the soak's clients' process that dies (here: a loopback URL whose
    port httpx refuses, before the first request) printed its traceback to the process's
    stderr, which the soak reads only when the process fails: the soak just had fewer
    requests. The last line names each client that ended early."""
    proc = subprocess.run(
        [sys.executable, "-m", "calexec.drivers.tools.chaos_clients", "http://127.0.0.1:port",
         "2", "1", "30"], input="", capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "started", lines
    last = json.loads(lines[-1])
    assert last["alive"] == 0, last
    assert sorted(what.split(":")[0] for what in last["crashed"]) == ["client 0", "client 1"], last
    assert all("InvalidURL" in what for what in last["crashed"]), last


def test_the_loop_lag_of_a_window_is_the_plain_scans():
    """``LoopLag.worst`` reads only the window's samples (bisection over the samples in the
    order handed): the same figure as a scan of every sample, on seeded samples, blocking
    waits (one not ended) and windows, edges included."""
    rng = random.Random(69)
    lag = chaos.LoopLag(asyncio.new_event_loop())
    handed = 0.0
    for _ in range(2000):
        handed += rng.choice([0.0, 0.01, rng.uniform(0.0, 0.05)])
        lag.samples.append((handed, rng.choice([0.0, rng.uniform(0.0, 0.8)])))
    lag.waits.extend(sorted((t, t + rng.uniform(0.0, 0.3)) for t in
                            (rng.uniform(0.0, handed) for _ in range(5))))

    def plain(start: float, end: float) -> float:
        return max((late for h, late in lag.samples if start <= h <= end
                    and not any(h <= freed and h + late >= since for since, freed in lag.waits)),
                   default=0.0)
    edges = [h for h, _ in rng.sample(lag.samples, 50)]
    windows = [(start, start + rng.uniform(0.0, 3.0))
               for start in (rng.uniform(-1.0, handed + 1) for _ in range(300))]
    windows += [(edge, edge + rng.choice([0.0, 0.5])) for edge in edges]
    windows += [(edge - width, edge) for edge in edges for width in (0.0, 0.2)]
    windows += [(float("-inf"), float("inf")), (handed + 5, handed + 6), (-2.0, -1.0)]
    for start, end in windows:
        assert lag.worst(start, end) == plain(start, end), (start, end)
    assert lag.worst(float("-inf"), float("inf")) > 0.0
