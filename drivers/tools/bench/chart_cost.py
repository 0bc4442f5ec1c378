"""``calexec bench charts [--json] [--iters N]``: per-job chart work on the hot path.

One decode job's chart work: a Job run along its success path, a KV txn reserve -> submitted
-> committed, and a buffer slot lease -> submit -> device_done -> give_back. Measured on the
compiled form (``ChartRun`` on tables compiled here from the declarations, so no listener is
attached to them, as in production: the test suite's coverage recorder listens on
``compiled.CHARTS``) and, in the same process, on fresh python-statemachine instances of the
same declarations as the baseline.
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable

from calexec import cliargs
from calexec.machines.charts import DECLARED
from calexec.machines.compiled import compile_chart

# The workload: events of one successful decode job, per chart.
JOB_EVENTS = ("admit", "begin_preparation", "enqueue", "infer_accepted", "wait_returned", "deliver")
KV_EVENTS = ("mark_submitted", "commit")
SLOT_EVENTS = ("lease", "submit", "device_done", "give_back")
#: the measured tables: compiled from the declarations, never given a listener
TABLES = {name: compile_chart(declaration, name) for name, declaration in DECLARED.items()}
WORKLOAD = ((TABLES["job"], JOB_EVENTS), (TABLES["kv_txn"], KV_EVENTS),
            (TABLES["buffer_slot"], SLOT_EVENTS))


class _SuccessModel:
    """Answers every guard of every chart with True: the success path of a healthy job."""


for _name in sorted({g for chart in TABLES.values() for g in chart.guard_names}):
    setattr(_SuccessModel, _name, lambda self: True)


def _compiled_job(model: _SuccessModel) -> None:
    for chart, events in WORKLOAD:
        run = chart.run(model)
        for event in events:
            run.send(event)


def _statemachine_job(_shared: _SuccessModel) -> None:
    for chart, events in WORKLOAD:
        # python-statemachine keeps the state on its model, so each machine needs its own.
        machine = chart.declaration(_SuccessModel())
        for event in events:
            machine.send(event)


def _percentile(sorted_us: list[float], fraction: float) -> float:
    return sorted_us[min(len(sorted_us) - 1, int(fraction * len(sorted_us)))]


def _measure(work: Callable[[_SuccessModel], None], iters: int,
             tick: Callable[[int], None] | None = None) -> list[float]:
    """Per-job microseconds of ``iters`` timed jobs (sorted); ``tick(done)`` after each one,
    outside the timed part."""
    model = _SuccessModel()
    for _ in range(min(iters, 200)):  # warm-up
        work(model)
    samples = []
    clock = time.perf_counter_ns
    for _ in range(iters):
        start = clock()
        work(model)
        samples.append((clock() - start) / 1000.0)
        if tick is not None:
            tick(len(samples))
    samples.sort()
    return samples


def run_bench(iters: int, progress: Callable[[str], None] | None = None,
              ticks: Callable[[str, int], Callable[[int], None]] | None = None
              ) -> dict[str, float | int | str | None]:
    """Measure both forms; return the figures (microseconds per job). ``progress`` is told
    which form is being measured (the default size takes seconds, most of them the baseline);
    ``ticks(form, iters)`` gives the ``tick(done)`` called after each job of that form (a
    :class:`calexec.cliargs.Ticker`: a large ``--iters`` is minutes per form)."""
    from calexec.drivers.tools.bench.core import cpu_model

    if progress is not None:
        progress(f"{iters} jobs on the compiled charts")
    compiled = _measure(_compiled_job, iters, ticks("compiled charts", iters) if ticks else None)
    if progress is not None:
        progress(f"{iters} jobs on python-statemachine (the baseline)")
    baseline = _measure(_statemachine_job, iters,
                        ticks("python-statemachine", iters) if ticks else None)
    p50, base_p50 = _percentile(compiled, 0.5), _percentile(baseline, 0.5)
    return {
        "per_job_chart_us_p50": round(p50, 2),
        "per_job_chart_us_p99": round(_percentile(compiled, 0.99), 2),
        "statemachine_us_p50": round(base_p50, 2),
        "statemachine_us_p99": round(_percentile(baseline, 0.99), 2),
        "speedup_p50": round(base_p50 / p50, 1),
        "transitions_per_job": sum(len(events) for _, events in WORKLOAD),
        "iters": iters,
        # the machine the figures are from (docs/benchmarks.md: a figure names its CPU)
        "cpu_model": cpu_model(), "cpus": os.cpu_count(),
        "python": platform.python_version(),
    }


def main(argv: list[str]) -> int:
    """Entry point; ``argv`` starts with the command words ``bench charts``."""
    parser = cliargs.parser("calexec bench charts", __doc__)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--iters", type=cliargs.count("bench charts --iters"), default=2000,
                        help="jobs per form (default 2000, at most "
                             f"{cliargs.MAX_COUNTS['bench charts --iters']})")
    args = parser.parse_args(argv[2:])
    cliargs.progress_s()  # (a bad $CALEXEC_PROGRESS_S refused before the run, not in it)
    result = run_bench(args.iters, lambda text: cliargs.say("bench charts", text),
                       lambda form, total: cliargs.Ticker("bench charts", f"{form}: jobs", total))
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:<24} {value}")
    return 0
