"""The interleaving explorer on a user's own threads (drivers/tools/interleave.py): what a
schedule's failure carries when the user's own checks raise."""

from __future__ import annotations

import pytest

from calexec.drivers.tools.interleave import explore_threads, replay_threads


def two_counters(clock):
    """Two threads bumping a counter under a lock made by ``clock``."""
    lock, counts = clock.lock(), [0]

    def bump():
        for _ in range(2):
            with lock:
                counts[0] += 1
    for name in ("a", "b"):
        clock.start_thread(bump, name)
    return counts


@pytest.mark.parametrize("where", ["final", "invariant"])
def test_a_check_that_raises_fails_the_schedule_with_its_seed_and_choices(where):
    """A final check or an ``invariant=`` written with ``assert`` (or one with a bug) raised
    out of ``explore_threads``: the schedule that broke it, its seed and its choices were lost,
    so it could not be replayed. It fails that schedule, naming the check and the error."""
    seen: list[list[int]] = []

    def scenario(clock):
        counts = two_counters(clock)
        seen.append(counts)

        def final():
            assert counts[0] == 5, f"count {counts[0]}"
        return final if where == "final" else None

    def invariant():
        if seen and seen[-1][0] == 3:
            raise KeyError("three")
        return True

    found = explore_threads(scenario, seeds=range(3),
                            invariant=invariant if where == "invariant" else None)
    assert found.failure is not None and found.failure.seed == 0
    expected = ("final check raised AssertionError: count 4" if where == "final"
                else "invariant raised KeyError: 'three'")
    assert found.failure.message.startswith(expected), found.failure.message
    again = replay_threads(scenario, found.failure.choices,
                           invariant=invariant if where == "invariant" else None)
    assert again is not None and again.message == found.failure.message
