"""The path of one job (issue 18): each job's taken transitions and refused events (with the
refusing guards) are kept for the most recent jobs and answered by ``job_trail``."""

from __future__ import annotations

import threading

from calexec.contracts.status import Status
from calexec.machines.pool import BufferSlot
from executor_harness import deadline, prefill, running_job_path, write_calbin


def test_a_delivered_job_shows_its_whole_path(tmp_path):
    with running_job_path(write_calbin(tmp_path)) as ex:
        handle = ex.enqueue(prefill(1, [1, 2, 3]))
        assert not isinstance(handle.wait_until(deadline()), Status)
        trail = ex.job_trail(handle.job_id)
        assert trail["status"] == "ok" and trail["state"] == "Succeeded"
        assert [(s["event"], s["from"], s["to"]) for s in trail["trail"]] == [
            ("admit", "Created", "Admitted"),
            ("begin_preparation", "Admitted", "Preparing"),
            ("enqueue", "Preparing", "Queued"),
            ("infer_accepted", "Queued", "Submitted"),
            ("wait_returned", "Submitted", "Completing"),
            ("deliver", "Completing", "Succeeded"),
        ]
        times = [s["t"] for s in trail["trail"]]
        assert times == sorted(times)


def test_a_cancelled_job_names_the_guard_that_refused_it(tmp_path, monkeypatch):
    with running_job_path(write_calbin(tmp_path)) as ex:
        original, paused, go = BufferSlot.prepare, threading.Event(), threading.Event()

        def prepare(slot, request):
            paused.set()
            go.wait(10)
            return original(slot, request)

        monkeypatch.setattr(BufferSlot, "prepare", prepare)
        handles = []
        thread = threading.Thread(target=lambda: handles.append(
            ex.enqueue(prefill(1, [1, 2, 3]), on_created=handles.append)))
        thread.start()
        assert paused.wait(10)
        handles[0].cancel()  # while preparing: the enqueue event is refused by its guard
        go.set()
        thread.join(10)
        res = handles[0].wait_until(deadline())
        assert isinstance(res, Status) and res.code == "request.cancelled"
        steps = ex.job_trail(handles[0].job_id)["trail"]
        refused = [s for s in steps if s["to"] is None]
        assert refused == [dict(refused[0], event="enqueue", refused_by=["not_cancelled"])]
        assert steps[-1]["to"] == "Failed"


def test_only_the_most_recent_jobs_are_kept(tmp_path):
    with running_job_path(write_calbin(tmp_path), job_trails_kept=2) as ex:
        ids = []
        for seq in (1, 2, 3):
            handle = ex.enqueue(prefill(seq, [1, 2]))
            handle.wait_until(deadline())
            ids.append(handle.job_id)
        assert ex.job_trail(ids[0]) is None
        assert ex.job_trail(ids[1]) is not None and ex.job_trail(ids[2]) is not None
