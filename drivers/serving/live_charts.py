"""The NPU server's live statecharts page: the generic inspector (machines/inspector.py)
mounted at ``/debug/statecharts`` (drivers/serving/debug.py), registered as any app would
register its own charts. What is specific to the executor is only where the counts come from:

- job: the server's requests' jobs (``CompletionService.live_job_counts``);
- KV txn: the open transactions of the current KV coordinator;
- buffer slot: the slots of the current pool;
- lifecycle: 1 on the current state;

and the status line: lifecycle, generation, golden pin state, disabled features and load.
Rates are ``CompiledChart.taken`` (monitoring only). The job chart's count the clients' jobs:
the executor's own (golden jobs, and armed jobs released before any request fired them: an auto
pre-arm guess, a decode stream's next step no token asked for, each taking ``fail``) count apart,
in ``DeviceExecutor.internal_job_transitions`` (until stop 64 they did not: under load the
``fail`` edge read 640/min against 944 admits with no request failing). The routes, relative
to the mount: ``/`` the page, ``/live.json``, ``/{chart}.svg`` (lifecycle: the current state
highlighted; job: the state holding most jobs). ``/debug/jobs/{id}`` (one job's path, admin) stays in debug.py and draws
with ``path_page`` here.

The screenshots of it in docs/diagrams.md are taken by ``calexec diagrams live``
(drivers/tools/live_screenshots.py).
"""

from __future__ import annotations

from collections.abc import Callable

from calexec.drivers.serving.executor_view import ServedExecutor
from calexec.machines.api import JobTrail
from calexec.machines.compiled import BUFFER_SLOT, CHARTS, JOB, KV_TXN, LIFECYCLE
from calexec.machines.inspector import Inspector, Json
from calexec.machines.inspector import path_page as chart_path_page

#: the page's status line: live.json ``status`` key -> label
LABELS = {"lifecycle": "lifecycle", "generation": "generation", "golden": "golden",
          "disabled_features": "disabled features", "load": "load"}
COUNTED = ("live objects in the state (jobs of the server's requests, open KV txns, buffer "
           "slots; lifecycle: the current state)")


def _kv_counts(executor: ServedExecutor) -> dict[str, int]:
    counts = dict.fromkeys(KV_TXN.states, 0)
    kvc = executor.kvc
    if kvc is not None:
        for view in list(kvc.seqs.values()):
            txn = view.open_txn
            state = getattr(txn, "state", None)
            if state in counts:
                counts[state] += 1
    return counts


def _status(executor: ServedExecutor) -> dict[str, Json]:
    snap = executor.snapshot()
    golden = str(snap.get("golden"))
    if snap.get("allow_unpinned_golden"):
        golden += " (allow_unpinned_golden)"
    features: list[Json] = [str(f) for f in snap.get("disabled_features", [])]
    return {"lifecycle": snap["lifecycle"], "generation": snap["generation"], "golden": golden,
            "disabled_features": features,
            "load": f"{snap['inflight']} in flight, {snap['queued']} queued"}


def server_inspector(executor: ServedExecutor,
                     job_counts: Callable[[], dict[str, int]]) -> Inspector:
    """The inspector of the server's four charts (in ``CHARTS`` order)."""
    inspector = Inspector(status=lambda: _status(executor))

    def lifecycle() -> dict[str, int]:
        state = executor.state
        return {s: int(s == state) for s in LIFECYCLE.states}

    def slots() -> dict[str, int]:
        found = executor.snapshot().get("slots")
        return dict(found) if found else dict.fromkeys(BUFFER_SLOT.states, 0)

    sources: dict[str, tuple[Callable[[], dict[str, int]], Callable[[], str | None] | None]] = {
        "job": (job_counts, None),
        "kv_txn": (lambda: _kv_counts(executor), lambda: None),
        "lifecycle": (lifecycle, lambda: executor.state),
        "buffer_slot": (slots, lambda: None),
    }
    for name, chart in CHARTS.items():
        counts, active = sources[name]
        # the executor runs compiled charts only: no class listener on the declarations
        inspector.register(chart, counts=counts, active=active, name=name, count_instances=False)
    return inspector


def path_page(record: JobTrail) -> str:
    """HTML of one job's path (a ``DeviceExecutor.job_trail`` record): the job chart with the
    path drawn, and the steps in order."""
    about = (f"sequence {record['seq_id']}, {record['kind']}, generation "
             f"{record['generation']}. Each guard's spec rule: calexec/machines/charts.py "
             "GUARD_RULES. ")
    return chart_path_page(JOB, record, f"job {record['job_id']}: {record['state']} "
                           f"({record['status']})", about)
