"""The §13.2 injections gate (`calexec accept`, ``injections_a``) can fail: a deliberately
broken executor makes it fail, the same run on the real executor passes.

§13.2: after cancel / timeout / fault injections the executor still passes the golden or is
explicitly Failed, and nothing waits for ever. Two broken executors, each the smallest bug
that breaks one half of that:

- **hangs**: a job that fails after submit is never resolved (its caller is never woken: a
  lost wake-up). The gate must count it hung.
- **leaks**: a job cancelled or past its deadline before submit never gives back its KV
  transaction, so its sequence stays claimed for ever. Nothing hangs and the executor stays
  Ready, but it can no longer run the golden on that sequence: the gate must fail on the
  golden.

Sizes are the gate's own code with fewer injections, chosen kinds (``INJECTION_KINDS``) and a
shorter hang grace (``HANG_GRACE_S``: how long past a job's deadline it counts as hung), so
each run takes about a second; the verdict logic is untouched. Each broken run has a control:
the same sizes on the real executor pass.
"""

from __future__ import annotations

import attrs
import pytest

from calexec.contracts.errors import Category
from calexec.contracts.status import Status
from calexec.drivers.tools.accept import gate_rig, gates
from calexec.drivers.tools.accept import run as accept
from calexec.machines.job import Job
from calexec.machines.outcomes import JobOutcomes

#: faults after submit only (each one a quarantined job and a recovery)
AFTER_SUBMIT = ("output_nan", "output_short", "ccu_exception")
#: request-side injections only: no device fault, so no recovery replaces the generation
REQUEST_SIDE = ("cancel", "deadline")


def injections_gate(monkeypatch, kinds: tuple[str, ...], n: int) -> dict:
    """Run ``injections_a`` alone with ``n`` injections of ``kinds``; its gate dict."""
    monkeypatch.setattr(gates, "INJECTION_KINDS", kinds)
    monkeypatch.setattr(gates, "HANG_GRACE_S", 0.3)
    monkeypatch.setattr(gate_rig, "HANG_GRACE_S", 0.3)
    sizes = attrs.evolve(accept.QUICK, mode="tiny", injections=n)
    report = accept.run_accept(sizes, ("a",), ["injections"])
    assert report["passed"] is report["gates"]["injections_a"]["passed"]
    return report["gates"]["injections_a"]


def never_wakes_a_failed_caller(monkeypatch) -> None:
    """Broken executor: a caller's job that failed after submit is never resolved."""
    real = Job.resolve

    def resolve(job, result):
        if (not job.internal and isinstance(result, Status)
                and job.timings.submitted_us and result.category is not Category.CANCELLED):
            job.result = result  # recorded, but the caller's wait is never ended
            return
        real(job, result)

    monkeypatch.setattr(Job, "resolve", resolve)


def leaks_the_kv_txn_of_a_refused_job(monkeypatch) -> None:
    """Broken executor: a job cancelled or expired before submit keeps its KV transaction
    open (its sequence claimed for ever); everything else is released."""
    real = JobOutcomes.fail_before_submit

    def fail_before_submit(outcomes, job, status):
        if not job.internal and status.category in (Category.CANCELLED, Category.DEADLINE):
            job.txn = None  # never rolled back
        return real(outcomes, job, status)

    monkeypatch.setattr(JobOutcomes, "fail_before_submit", fail_before_submit)


@pytest.mark.parametrize("broken", [False, True], ids=["real", "never_wakes"])
def test_the_gate_counts_a_job_that_never_resolves_as_hung(monkeypatch, broken):
    if broken:
        never_wakes_a_failed_caller(monkeypatch)
    gate = injections_gate(monkeypatch, AFTER_SUBMIT, 3)
    details = gate["details"]
    if not broken:
        assert gate["passed"] and gate["value"] == 0, details
        assert details["golden_passed"] and details["recoveries"] >= 1, details
        return
    assert gate["passed"] is False and gate["metric"] == "hung", details
    assert gate["value"] >= 1, details  # the gate saw the jobs that never resolved


@pytest.mark.parametrize("broken", [False, True], ids=["real", "leaks"])
def test_the_gate_fails_when_injections_leave_the_executor_unable_to_pass_its_golden(
        monkeypatch, broken):
    if broken:
        leaks_the_kv_txn_of_a_refused_job(monkeypatch)
    gate = injections_gate(monkeypatch, REQUEST_SIDE, 14)
    details = gate["details"]
    assert details["final_state"] == "Ready" and details["recoveries"] == 0, details
    assert gate["value"] == 0, details  # nothing hung, either way
    if not broken:
        assert gate["passed"] and details["golden_passed"] is True, details
        return
    # Ready, nothing hung, but the golden cannot run: neither §13.2 ending
    assert gate["passed"] is False, details
    assert details["golden_passed"] is False, details
