"""The interleaving explorer (calexec.drivers.tools.explore, issue 14): the executor's real threads
run one at a time under a controlled scheduler with a virtual clock, the stepped emulator's
stages are scheduling choices, and every schedule is checked (docs/testing.md).

Sizes: ``CALEXEC_EXPLORE_SCHEDULES`` schedules in all (CI: 2000, locally 200), a fifth of them
as hypothesis examples of the stateful machine (shrinking schedules), the rest PCT-random
scenarios from consecutive seeds starting at ``CALEXEC_EXPLORE_SEED`` (default 0). Nightly:
``CALEXEC_EXPLORE_SCHEDULES=100000 CALEXEC_EXPLORE_SEED=$RANDOM python -m pytest -q
tests/test_explorer.py``.
"""

from __future__ import annotations

import gc
import logging
import os

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule

from calexec.contracts.status import Status
from calexec.drivers.tools import explore as X

SCHEDULES = int(os.environ.get("CALEXEC_EXPLORE_SCHEDULES",
                               "2000" if os.environ.get("CI") else "200"))
FIRST_SEED = int(os.environ.get("CALEXEC_EXPLORE_SEED", "0"))
EXAMPLES = max(SCHEDULES // 5, 10)
CALBINS: dict[str, str] = {}


@pytest.fixture(scope="module", autouse=True)
def _calbins(tmp_path_factory):
    CALBINS.update(X.write_calbins(str(tmp_path_factory.mktemp("explore"))))
    logging.disable(logging.ERROR)  # recoveries log by design; failures carry their own report
    # every object made before this module (the whole session's collected tests, pytest's and
    # hypothesis's state) out of the cyclic collector's sight while the explorers run: an
    # Explorer's close collects every 4 explorers, and each full collection walked all of them
    # (0.3-0.7 s a collection on the 2-core CI host, most of this module's time). The
    # explorers' own cycles are made after the freeze: collected as before.
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()
    logging.disable(logging.NOTSET)


# ---- the scheduler itself, on toy programs --------------------------------------------------------
def toy(chooser, program):
    sched = X.Scheduler(chooser)
    clock = X.VirtualClock(sched)
    program(sched, clock)
    try:
        why = sched.run(10_000, 100.0)
        return sched, why, [t.label for t in sched.threads if not t.finished]
    finally:
        sched.abort_threads()


def lock_order_inversion(sched, clock):
    a, b = clock.lock(), clock.lock()

    def one():
        with a:
            with b:
                pass

    def two():
        with b:
            with a:
                pass
    sched.spawn(one, "one")
    sched.spawn(two, "two")


def test_no_preemption_runs_a_lock_inversion_to_completion():
    sched, why, stuck = toy(X.TapeChooser(), lock_order_inversion)
    assert why == "quiescent" and stuck == []


def test_some_schedule_deadlocks_the_lock_inversion_and_replays_exactly():
    found = None
    for seed in range(50):
        sched, why, stuck = toy(X.PCTChooser(seed, depth=2, steps=8), lock_order_inversion)
        if why == "quiescent" and stuck:
            found = sched.choices
            break
    assert found is not None, "no PCT schedule of 50 deadlocked a two-lock inversion"
    again, why, stuck = toy(X.ReplayChooser(found), lock_order_inversion)
    assert why == "quiescent" and sorted(stuck) == ["one#0", "two#1"]
    assert again.choices == found


def test_virtual_time_jumps_only_when_every_thread_waits():
    seen = []

    def program(sched, clock):
        def sleeper():
            t0 = clock.monotonic()
            clock.sleep(3600.0)
            seen.append(clock.monotonic() - t0)
        sched.spawn(sleeper, "sleeper")
    sched, why, _ = toy(X.TapeChooser(), program)
    assert seen == [3600.0] and why == "quiescent"


def test_a_condition_wait_times_out_on_the_virtual_clock():
    got = []

    def program(sched, clock):
        cond = clock.condition(clock.lock())

        def waiter():
            with cond:
                got.append(clock.wait(cond, 5.0))
        sched.spawn(waiter, "waiter")
    sched, _, _ = toy(X.TapeChooser(), program)
    assert got == [False] and sched.now == 1005.0


# ---- the executor under the explorer ------------------------------------------------------------------
def test_a_schedule_serves_requests_and_shuts_down_clean():
    x = X.Explorer(CALBINS)
    try:
        x.start()
        x.prefill(1, 4)
        x.prefill(2, 3)
        assert x.run() == "quiescent"
        results = [r for _, _, r in x.results]
        assert [type(r).__name__ for r in results] == ["InferenceResult"] * 2
        assert sorted(r.kv_len for r in results) == [3, 4]
        x.finish()
        assert x.ex.state == "Stopped"
    finally:
        x.close()


@pytest.fixture
def leaky_budget(monkeypatch):
    """A planted bug: a request's token budget is never given back."""
    from calexec.machines.dispatch import Dispatch
    original = Dispatch.release_budget

    def leaky(self, job):
        if not job.internal:
            return
        original(self, job)
    monkeypatch.setattr(Dispatch, "release_budget", leaky)


def _failed_prefill(seq: int) -> X.ExplorationFailure:
    """The failure an explorer reports for one prefill of ``seq`` (a bug planted first)."""
    x = X.Explorer(CALBINS)
    with pytest.raises(X.ExplorationFailure) as failed:
        try:
            x.start()
            x.prefill(seq, 4)
            x.run()
        finally:
            x.close()
    return failed.value


def test_a_leak_is_found_and_the_report_replays_it(leaky_budget):
    """A planted bug (the token budget is never given back) is reported with a replay file
    that reproduces the same failure."""
    first = _failed_prefill(1)
    assert "pending_tokens=4" in str(first)
    info = first.replay_info
    with pytest.raises(X.ExplorationFailure) as again:
        X.replay(CALBINS, info["script"], info["choices"], **info["options"])
    assert str(again.value).split("\n")[0] == str(first).split("\n")[0]


def test_each_failure_report_names_a_replay_file_of_its_own(leaky_budget, monkeypatch,
                                                             tmp_path):
    """Found at stop 58: the replay file a failure's message names
    (``replay_file('/tmp/calexec-explore-PID-N.json')``) was named by the process and the
    number of choices alone, so a second failure with as many choices in the same process
    (a test session, a loop over scenarios) overwrote it: the first message's replay then
    ran the second failure's script. Each failure now has a file of its own, and
    ``replay_file`` of each reproduces its own failure."""
    import json
    import re
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    failures = [_failed_prefill(seq) for seq in (1, 2)]
    paths = [re.search(r"replay_file\('([^']+)'\)", str(f)).group(1) for f in failures]
    assert paths[0] != paths[1], paths
    for failure, path in zip(failures, paths, strict=True):
        with open(path) as f:
            assert json.load(f)["script"] == json.loads(json.dumps(failure.replay_info["script"]))
        with pytest.raises(X.ExplorationFailure) as again:
            X.replay_file(path, CALBINS)
        assert str(again.value).split("\n")[0] == str(failure).split("\n")[0]


def test_a_failures_replay_file_is_written_where_the_environment_says(leaky_budget, monkeypatch,
                                                                   tmp_path):
    """Found at stop 59: a failure's replay file always went to the temporary directory, so
    every test expecting a failure left a ``/tmp/calexec-explore-*.json`` behind, run after
    run, and a CI job could not collect them as artifacts. ``CALEXEC_EXPLORE_REPLAY_DIR``
    names the directory (made when missing)."""
    import re

    where = tmp_path / "replays" / "of this run"
    monkeypatch.setenv("CALEXEC_EXPLORE_REPLAY_DIR", str(where))
    failure = _failed_prefill(1)
    path = re.search(r"replay_file\('([^']+)'\)", str(failure)).group(1)
    assert os.path.dirname(path) == str(where)
    assert os.path.isfile(path)


def test_replaying_a_file_without_calbins_leaves_no_directory_behind(leaky_budget, monkeypatch,
                                                                     tmp_path):
    """Found at stop 59: ``replay_file(path)`` (no calbins: the replay writes its own) made a
    ``calexec-explore-*`` directory of two calbins in the temporary directory for every
    replay and never removed it; it is removed when the replay ends, failing or not."""
    import re
    import tempfile

    monkeypatch.setenv("CALEXEC_EXPLORE_REPLAY_DIR", str(tmp_path / "replays"))
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    failure = _failed_prefill(1)
    path = re.search(r"replay_file\('([^']+)'\)", str(failure)).group(1)
    with pytest.raises(X.ExplorationFailure) as again:
        X.replay_file(path)
    assert str(again.value).split("\n")[0] == str(failure).split("\n")[0]
    assert [p.name for p in scratch.iterdir() if p.is_dir()] == []


@pytest.mark.contract_violations_expected
def test_a_violated_chart_contract_is_reported_by_the_explorer(monkeypatch):
    """A planted bug: the KV commit guard says yes once and the txn's own evidence says no
    right after (as a guard forced true would): the KV txn chart's contract
    (``commits_only_after_device_done_and_valid``, machines/charts.py) fails the schedule."""
    from calexec.machines.kv import KvTxn

    asked: dict[int, int] = {}

    def flip(self):
        asked[id(self)] = asked.get(id(self), 0) + 1
        return asked[id(self)] == 1
    monkeypatch.setattr(KvTxn, "device_finished_and_output_valid", flip)
    x = X.Explorer(CALBINS)
    with pytest.raises(X.ExplorationFailure) as failure:
        try:
            x.start()
            x.prefill(1, 4)
            x.run()
        finally:
            x.close()
    assert "commits_only_after_device_done_and_valid" in str(failure.value)
    assert "chart contract violated: kv_txn: invariant" in str(failure.value)


def test_pct_random_schedules():
    """PCT schedules of random scenarios (traffic, decode streams pre-armed and greedy ahead,
    faults, hangs, recoveries, switches, refused goldens, cancels, bad arguments, sequence
    releases racing the streams, a mid-run shutdown, the final shutdown)."""
    count = SCHEDULES - EXAMPLES
    for seed in range(FIRST_SEED, FIRST_SEED + count):
        X.explore_seed(CALBINS, seed)  # raises ExplorationFailure naming the seed


# ---- hypothesis: scenario and schedule drawn together, failures shrink -------------------------------
class ExplorerMachine(RuleBasedStateMachine):
    @initialize(no_safe_reset=st.booleans(), small_kv=st.booleans(),
                pct=st.one_of(st.none(), st.tuples(st.integers(0, 2**32 - 1), st.integers(1, 4))))
    def start(self, no_safe_reset, small_kv, pct):
        """``pct``: None schedules by the drawn tapes (they shrink); (seed, depth) by a PCT
        chooser (the tapes are then unused; the failure still shrinks its actions)."""
        chooser = X.PriorityTapeChooser() if pct is None else X.PCTChooser(*pct)
        self.x = X.Explorer(CALBINS, chooser, reset_kind="none" if no_safe_reset else "reset",
                            kv_blocks=8 if small_kv else 64)
        self.x.start()

    @rule(seq=st.sampled_from(X.SEQS), n=st.integers(1, 20),
          deadline=st.sampled_from((0.05, 0.5, 5.0)), rewind=st.booleans())
    def prefill(self, seq, n, deadline, rewind):
        self.x.prefill(seq, n, deadline, rewind)

    @rule(seq=st.sampled_from(X.SEQS), deadline=st.sampled_from((0.05, 0.5, 5.0)))
    def decode(self, seq, deadline):
        self.x.decode(seq, deadline)

    @rule(seq=st.sampled_from(X.SEQS), steps=st.integers(1, 4), greedy=st.booleans(),
          deadline=st.sampled_from((0.05, 0.5, 5.0)))
    def stream(self, seq, steps, greedy, deadline):
        self.x.stream(seq, steps, greedy, deadline)

    @rule()
    def shutdown(self):
        self.x.shutdown()

    @rule(which=st.integers(0, 2))
    def bad_argument(self, which):
        self.x.bad_argument(which)

    @rule(index=st.integers(0, 7))
    def cancel(self, index):
        self.x.cancel(index)

    @rule(point=st.sampled_from(X.FAULTS), nth=st.integers(1, 3))
    def arm(self, point, nth):
        self.x.arm(point, nth)

    @rule()
    def hang_next_job(self):
        self.x.arm("HANG", 1)

    @rule()
    def request_recovery(self):
        self.x.request_recovery()

    @rule(to_other=st.booleans(), golden_ok=st.booleans())
    def switch(self, to_other, golden_ok):
        self.x.switch(to_other, golden_ok)

    @rule(seq=st.sampled_from(X.SEQS))
    def reset_sequence(self, seq):
        self.x.reset_sequence(seq)

    @rule(steps=st.one_of(st.just(1_000_000), st.integers(1, 120)),
          tape=st.lists(st.integers(0, 7), max_size=24))
    def run(self, steps, tape):
        self.x.run(steps, tape=tape)

    def teardown(self):
        x = getattr(self, "x", None)
        if x is None:
            return
        try:
            if x.started_ex is not None and x.sched.failure is None:
                x.finish()
        finally:
            x.close()


ExplorerMachine.TestCase.settings = settings(
    max_examples=EXAMPLES, stateful_step_count=12, deadline=None,
    # no explain phase: it traces every line of every thread (minutes per failure); the
    # explorer's own report names the failing schedule and its replay
    phases=[phase for phase in Phase if phase is not Phase.explain],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestExplorerStateful = ExplorerMachine.TestCase


# ---- found by the explorer on main, fixed: a model switch racing shutdown ---------------------------
@pytest.mark.parametrize("seed", [4, 11, 23, 37, 58])
def test_a_model_switch_racing_shutdown_never_tears_down_under_it(seed):
    """Shutdown joined the controller's recovery thread but not a caller's switch_model and
    tore the generation down under it (IllegalTransition 'recover' in 'Stopped', GuardRejected,
    AttributeError: 5 of 60 PCT seeds). Shutdown now waits for the switch (recovery_mu)."""
    x = X.Explorer(CALBINS, X.PCTChooser(seed, depth=3, steps=80))
    try:
        x.start()
        for action in (("prefill", 1, 4, 5.0, False), ("switch", True, True), ("shutdown",),
                       ("run", 1000000, 30.0), ("finish",)):
            X.perform(x, action)
        assert x.ex.state == "Stopped"
    finally:
        x.close()


# ---- found by the explorer on main (stop 37), fixed: a cancel after the row was written ---------
def test_a_cancel_that_comes_once_the_caller_row_is_written_is_too_late():
    """The completion thread chose the caller's row for a decode (not cancelled yet), wrote
    it, and a cancel came before the deliver: the result was discarded as cancelled with the
    row written. Now the completion thread claims the row (``Job.claim_row``) and a cancel
    after the claim is too late: the job delivers what the row holds. The schedule is the
    failure's, replayed as far as it fits the fixed code."""
    choices = [1, 0, 1, 0, 1, 0, 0, 0, 0, 0, 2, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0,
               0, 2, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 2,
               0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0,
               2, 1, 0, 0, 0, 0, 0, 0, 1, 0]
    x = X.replay(CALBINS, [("decode", 1, 0.05), ("run", 29, 30.0), ("cancel", 0), ("finish",)],
                 choices, lenient=True, reset_kind="reset", capacity=1, kv_blocks=64,
                 slack_s=0.1)
    [(handle, _request, result)] = x.results
    assert not isinstance(result, Status), result  # delivered: the cancel came too late
    assert handle.cancel() is False


# ---- found by the explorer on main (stop 51), fixed: the oracle check's order of commits ---------
def test_the_oracle_check_replays_a_sequence_in_commit_order_not_job_id_order():
    """PCT seed 57378 (``CALEXEC_EXPLORE_SEED=51000``, 15,000 schedules; Phase B, no safe
    reset) failed "job 6 (seq 2 at 1): logits differ from the oracle". The executor was
    right: job 6 (a prefill of seq 2 at 1, made while the sequence held 1 token) was
    admitted after job 7 (seq 2 rewound to 0, four tokens) had committed, so it ran on job
    7's position 0 and its logits are the oracle's for that history. The check replayed
    the sequence's commits sorted by completion time, ties by job id; the explorer's device
    takes no virtual time, so every job completed at the same instant and the check took
    job 6 before job 7. It now breaks ties by the order the jobs were resolved (one thread
    completes them, committing first), recorded by a done callback. The schedule is the
    failure's (tests/data/explore_seed57378.json), run under the failure's own PCT
    priorities (``pct``: thread priorities, not choice indices, so a change that adds or
    removes a lock acquisition elsewhere does not move the window; the recorded choice tape
    replayed leniently stopped reaching it when stop 68's KV admission took its lock once
    where it took it twice)."""
    import json
    from pathlib import Path

    from calexec.machines.job import job_of

    info = json.loads((Path(__file__).parent / "data" / "explore_seed57378.json").read_text())
    x = X.Explorer(CALBINS, X.PCTChooser(*info["pct"]), **info["options"])
    try:
        x.start()
        for action in info["script"]:
            X.perform(x, tuple(action))
    finally:
        x.close()
    jobs = {job_of(h).job_id: job_of(h) for h in x.handles}
    rewind, later = jobs[7], jobs[6]
    # the window: the rewind (the higher id) committed first, at the same virtual instant
    assert (rewind.request.seq_id, rewind.request.past_len) == (2, 0)
    assert (later.request.seq_id, later.request.past_len) == (2, 1)
    assert rewind.txn.run.state == later.txn.run.state == "Committed"
    assert rewind.timings.completed_us == later.timings.completed_us
    assert x.resolved_order[7] < x.resolved_order[6], x.resolved_order
    assert x.logits_problems() == []


# ---- found by the explorer on main (stop 38), fixed: a kept job's grace after a downgrade -------
def test_a_job_in_flight_behind_a_kept_one_is_completed_by_its_deadline_after_a_downgrade():
    """Phase B, two jobs in flight: the first one's Wait failed with the device still holding
    it, which downgraded the executor to one job in flight. The completion thread then saw a
    capacity of 1, took it for "nothing else on the device" and waited the 0.2 s grace for
    the kept job, while the second job, submitted before the downgrade, waited behind it
    past its own execution deadline. Now it waits the grace only when the kept job's permit
    is the only one held. PCT seed 39106 (``CALEXEC_EXPLORE_SEED=38000``, 15,000 schedules),
    shrunk to a schedule of no preemptions."""
    script = [("decode", 2, 5.0), ("arm", "HANG", 1), ("run", 1000000, 30.0),
              ("prefill", 1, 2, 0.5, True), ("arm", "HANG", 1), ("prefill", 3, 13, 5.0, False),
              ("reset_sequence", 2), ("finish",)]
    x = X.replay(CALBINS, script, [], lenient=True, reset_kind="reset", capacity=2,
                 kv_blocks=64, slack_s=0.1)
    assert x.ex.snapshot()["inflight_capacity"] == 1  # the scenario did downgrade


@pytest.mark.parametrize("content, says", [
    ("not json\n", "no JSON (Expecting value: line 1 column 1 (char 0))"),
    (b"\xff\xfe", "no JSON ("),
    ("[1, 2]\n", "a JSON list, where the explorer writes an object with options, script and "
                 "choices"),
    ('{"seed": 3}', "no 'options'"),
    ('{"options": {}, "script": {}, "choices": []}', "script={} is no JSON array"),
    ('{"options": {}, "script": [], "choices": [1, -2]}',
     "choices holds -2, where each is an integer >= 0"),
])
def test_replay_file_refuses_a_file_that_is_no_replay_naming_it(tmp_path, monkeypatch,
                                                               content, says):
    """``replay_file`` on a file that is no replay (a typo'd path to another JSON, a truncated
    copy) raised ``JSONDecodeError: Expecting value``, ``KeyError: 'options'`` or ``TypeError:
    list indices must be integers``, naming neither the file nor what to give; it is a
    ``ValueError`` naming the file, what is wrong and which path to give, before any calbin is
    written or explorer started."""
    import tempfile

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    path = tmp_path / "trace.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    with pytest.raises(ValueError) as refused:
        X.replay_file(str(path))
    message = str(refused.value)
    assert message.startswith(f"replay_file({str(path)!r}): not a replay file the explorer "
                              "wrote (give the path a failure's '--- replay: "), message
    assert says in message, message
    assert list(scratch.iterdir()) == []  # nothing written: no calbins directory
