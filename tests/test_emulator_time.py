"""The emulated device's modelled time (issue 28, stop 68).

A stage starts in the model when the job is ready (``infer()``, then the end of its previous
stage), its engine is free and any resource the overlap rules made it wait for was released,
never after its thread started it, and ends ``max(latency, work)`` after that start; so a
job completes at ``infer()`` plus its stages' profiles whatever its engine thread's wake-up
lateness. The arithmetic is checked in C (drivers/calrt/emu_check.c: given instants, no
clock, no timing threshold). The engine threads, and only they, sleep with a 1 ns timer slack:
the host's Python threads keep theirs.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from calexec.drivers.calrt.runtime import CalRT
from calexec.drivers.direct import DirectRunner
from calexec.drivers.synthetic import calbin

CALRT_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                         "drivers", "calrt")


def test_modelled_stage_time_does_not_move_with_the_threads_lateness(tmp_path):
    make = shutil.which("make")
    assert make is not None  # CI's machines have make and a C compiler
    build = subprocess.run([make, "-s", "-C", CALRT_DIR, "emu-check", f"O={tmp_path}"],
                           capture_output=True, text=True, timeout=300, check=False)
    assert build.returncode == 0, build.stderr or build.stdout
    done = subprocess.run([str(tmp_path / "emu_check")], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == "emu_check: 17 checks passed"


def _slack_ns(tid: int) -> int:
    with open(f"/proc/{tid}/timerslack_ns", encoding="ascii") as f:
        return int(f.read())


def _threads_named(prefix: str) -> list[int]:
    tids = []
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm", encoding="ascii") as f:
            if f.read().strip().startswith(prefix):
                tids.append(int(tid))
    return tids


def test_engine_threads_sleep_with_1ns_slack_and_python_threads_keep_theirs(tmp_path):
    if not os.path.exists("/proc/self/timerslack_ns"):
        pytest.skip("no /proc/<pid>/timerslack_ns on this kernel")
    own = _slack_ns(os.getpid())
    path = tmp_path / "q.calbin"
    calbin.write(str(path), calbin.default_spec(seed=7))
    runner = DirectRunner(CalRT.load(), str(path))
    try:
        engines = _threads_named("calrt-emu-e")
        assert engines, "the device's engine threads are named calrt-emu-eN"
        try:
            slacks = [_slack_ns(tid) for tid in engines]
        except PermissionError:
            pytest.skip("reading another thread's timer slack needs CAP_SYS_NICE here")
        assert slacks == [1] * len(engines)
        assert _slack_ns(os.getpid()) == own  # the calling (Python) thread's is untouched
    finally:
        runner.close()


def _voluntary_switches(tid: int) -> int:
    with open(f"/proc/self/task/{tid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("voluntary_ctxt_switches:"):
                return int(line.split()[1])
    raise AssertionError(f"no voluntary_ctxt_switches in /proc/self/task/{tid}/status")


def test_an_idle_engine_sleeps_through_the_other_engines_jobs(tmp_path):
    """Not in parallel mode every job runs on engine 0: engine 1's thread is not woken by
    them (it was, at every stage and signal of each job: about 6 wake-ups a job, a host
    core's CPU taken at the moments the host's own threads wake for the result)."""
    if not os.path.exists("/proc/self/task"):
        pytest.skip("no /proc/self/task here")
    path = tmp_path / "q.calbin"
    calbin.write(str(path), calbin.default_spec(seed=7))
    runner = DirectRunner(CalRT.load(), str(path))
    try:
        idle = _threads_named("calrt-emu-e1")
        assert idle, "the device's engine threads are named calrt-emu-eN"
        runner.run(calbin.PREFILL_IDS, 0, 0, tokens=[5, 6, 7])
        before = [_voluntary_switches(tid) for tid in idle]
        jobs = 40
        token = 1
        for past in range(3, 3 + jobs):
            runner.run(calbin.DECODE, 0, past, tokens=[token])
            token = (token * 31 + 7) % 1000
        woken = sum(_voluntary_switches(tid) for tid in idle) - sum(before)
        assert woken <= 2, f"engine 1 woke {woken} times over {jobs} jobs of engine 0"
    finally:
        runner.close()
