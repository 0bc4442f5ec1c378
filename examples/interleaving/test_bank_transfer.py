"""The interleaving explorer on a user's own threads (docs/framework.md): it finds the seeded
check-then-act race of ``Bank(racy=True)``, the ``Transfer`` chart's contract names it, the
recorded choices replay it exactly, and the fixed bank passes every explored schedule.
Public API only: ``calexec.drivers.tools.interleave`` and ``calexec.machines``."""

from __future__ import annotations

import os

from bank_transfer import Transfer, two_transfers

from calexec.drivers.tools.interleave import explore_threads, replay_threads
from calexec.machines.clock import SYSTEM

#: schedules per exploration (a longer run: CALEXEC_EXPLORE_SCHEDULES=2000)
SCHEDULES = int(os.environ.get("CALEXEC_EXPLORE_SCHEDULES", "200"))


def scenario(racy: bool):
    def build(clock):
        results: list[str] = []
        alice, bob, _ = two_transfers(clock, racy, results)  # the explorer runs them out

        def final():
            if alice.balance + bob.balance != 100:
                return f"money created or lost: {alice}, {bob}"
            return sorted(results) == ["done", "refused"] or f"results {results}"
        return final
    return build


def test_the_explorer_finds_the_race_and_the_contract_names_it():
    found = explore_threads(scenario(racy=True), seeds=range(SCHEDULES), charts=[Transfer])
    assert found.failure is not None, f"no failing schedule in {found.schedules}"
    print(f"race found by schedule {found.schedules} (seed {found.failure.seed}), "
          f"{len(found.failure.choices)} choices")
    message = found.failure.message
    assert "chart contract violated" in message and "source_never_overdrawn" in message
    assert "Account(alice, -60)" in message
    again = replay_threads(scenario(racy=True), found.failure.choices, charts=[Transfer])
    assert again is not None and again.message == message
    assert again.choices == found.failure.choices


def test_without_the_contract_the_final_check_still_catches_it():
    found = explore_threads(scenario(racy=True), seeds=range(SCHEDULES))
    assert found.failure is not None
    assert found.failure.message.startswith("final check: results")


def test_the_fixed_bank_passes_every_explored_schedule():
    found = explore_threads(scenario(racy=False), seeds=range(SCHEDULES), charts=[Transfer])
    assert found.failure is None, found.failure
    assert found.schedules == SCHEDULES


def test_the_same_code_runs_on_real_threads():
    results: list[str] = []
    alice, bob, threads = two_transfers(SYSTEM, False, results)
    for thread in threads:
        thread.join(10)
    assert not any(thread.is_alive() for thread in threads)
    assert sorted(results) == ["done", "refused"] and (alice.balance, bob.balance) == (20, 80)
