"""What ``ChartRun.send`` costs with contracts off (production) and on (issue 26: the contract
hook in machines/compiled.py must leave the executor's hot path at one attribute test). A
micro timing loop over the job chart's happy path (7 events per run), printed, not asserted;
pytest does not collect it. Run:

    python tests/measure_chartrun_send.py [--runs 20000] [--repeat 5]
"""

from __future__ import annotations

import argparse
import time

from calexec.machines.compiled import JOB

HAPPY = ("admit", "begin_preparation", "enqueue", "infer_accepted", "wait_returned", "deliver")


class Job:
    """Guards of a job that runs cleanly."""

    def not_cancelled(self) -> bool:
        return True

    def runtime_finished_cleanly(self) -> bool:
        return True

    def output_validated(self) -> bool:
        return True

    def runtime_not_using_buffers(self) -> bool:
        return True


def per_send_ns(runs: int) -> float:
    model = Job()
    start = time.perf_counter_ns()
    for _ in range(runs):
        run = JOB.run(model)
        for event in HAPPY:
            run.send(event)
    return (time.perf_counter_ns() - start) / (runs * len(HAPPY))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    best = min(per_send_ns(args.runs) for _ in range(args.repeat))
    print(f"ChartRun.send, contracts off: {best:.0f} ns/event (best of {args.repeat} x "
          f"{args.runs} runs x {len(HAPPY)} events)")
    if not hasattr(JOB, "set_checker"):  # the code before the contract hook
        return
    from calexec.machines.chart_contracts import contracts_checked

    with contracts_checked(JOB):
        best = min(per_send_ns(args.runs) for _ in range(args.repeat))
    print(f"ChartRun.send, contracts on:  {best:.0f} ns/event")


if __name__ == "__main__":
    main()
