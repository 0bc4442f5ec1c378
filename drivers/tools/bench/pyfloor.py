"""The Python-threads floor of ``calexec bench overhead`` (issue 28).

The C floor (drivers/calrt/floor.c) says what the executor's two device threads could at best
cost per token. The executor is Python, and its thread roles put two more wake-ups on a decode
token's path than the direct loop has: caller -> submitter (only the submitter calls
``infer``, invariant 2) and completion thread -> caller (only the completion thread calls
``Wait``); the submitter -> completion hand-off runs while the device computes. In CPython
each wake-up also waits for the GIL, which the C floor does not pay.

:class:`ThreadedLoop` is the direct loop with exactly the executor's three roles and nothing
else: the calling thread hands ``(token, position)`` to a submitter thread (a condition, as
the executor's ``submit_cv``), the submitter fills the inputs, sets the CSRs, Applies the KV
and calls ``infer`` (``DirectRunner.submit``, the direct loop's own calls) and hands the job
to a completion thread (a condition, as ``completion_cv``), which ``Wait``s, reads the
status, converts the valid row into a preallocated FP32 row and takes its argmax (the direct
loop's conversion) and wakes the caller (an event, as the job's). No charts, queues of jobs,
KV transactions, leases, admission, validation or timings: its per-token time minus the
direct loop's is what the thread roles alone cost on this host, and a mode's time minus this
one's is its control work. Every wait is bounded (``wait_s``); a failure in either thread is
raised to the caller as :class:`ThreadedLoopError` naming the thread and the call.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np

from calexec.drivers.calrt.runtime import CalRT, JobStatus
from calexec.drivers.direct import DirectRunner
from calexec.drivers.synthetic import calbin as calbin_fmt
from calexec.machines.postprocess import bf16_to_f32_into

#: what the report says about this side (``threads_floor`` in ``bench overhead``)
THREADS = 3
HANDOFFS_PER_TOKEN = 3
MODULE = "drivers/tools/bench/pyfloor.py"


class ThreadedLoopError(RuntimeError):
    """A block of the threaded loop failed (the message names the thread and the call)."""


class ThreadedLoop:
    """The direct loop run by the executor's three thread roles (module docstring)."""

    def __init__(self, rt: CalRT, calbin_path: str, seq_id: int, wait_s: float = 30.0) -> None:
        self.runner = DirectRunner(rt, calbin_path)
        self.seq_id = seq_id
        self.wait_s = wait_s
        self.row = np.empty(calbin_fmt.VOCAB, dtype=np.float32)
        self._submit_cv = threading.Condition(threading.Lock())
        self._completion_cv = threading.Condition(threading.Lock())
        self._done = threading.Event()
        self._work: tuple[int, int] | None = None  # (token, past) for the submitter
        self._submitted = False  # a job for the completion thread
        self._token = -1
        self._error: str | None = None
        self._stopping = False
        self._threads = [
            threading.Thread(target=self._guard, args=(self._submitter,), daemon=True,
                             name="calexec-bench-pyfloor-submitter"),
            threading.Thread(target=self._guard, args=(self._completion,), daemon=True,
                             name="calexec-bench-pyfloor-completion"),
        ]
        for thread in self._threads:
            thread.start()

    def set_decode_latency(self, decode_us: int) -> None:
        rc = self.runner.device.emu.set_latency(decode_us=decode_us)
        if rc != 0:
            raise ThreadedLoopError(f"threads floor device: set_latency(decode_us={decode_us}) "
                                    f"returned {rc}")

    # ---- the two device threads --------------------------------------------------------------
    def _guard(self, body: Callable[[], None]) -> None:
        try:
            body()
        except (RuntimeError, OSError, ValueError, KeyError) as exc:  # the caller raises it
            # (DriverError and ThreadedLoopError are RuntimeErrors; anything else ends the
            # thread and the caller's bounded wait reports no token)
            self._error = f"{threading.current_thread().name}: {exc}"
            self._done.set()

    def _submitter(self) -> None:
        runner, cv = self.runner, self._submit_cv
        while True:
            with cv:
                while self._work is None and not self._stopping:
                    cv.wait(self.wait_s)
                if self._stopping:
                    return
                work, self._work = self._work, None
            if work is None:  # (the wait's bound passed with nothing to do)
                continue
            token, past = work
            rc = runner.submit(calbin_fmt.DECODE, self.seq_id, past, tokens=[token])
            if rc != 0:
                raise ThreadedLoopError(f"infer(seq={self.seq_id}, past={past}) returned {rc}")
            with self._completion_cv:
                self._submitted = True
                self._completion_cv.notify()

    def _completion(self) -> None:
        runner, cv = self.runner, self._completion_cv
        while True:
            with cv:
                while not self._submitted and not self._stopping:
                    cv.wait(self.wait_s)
                if self._stopping:
                    return
                submitted, self._submitted = self._submitted, False
            if not submitted:  # (the wait's bound passed with nothing to do)
                continue
            status = runner.finish(calbin_fmt.DECODE, int(self.wait_s * 1e6))
            if status != JobStatus.DONE:
                raise ThreadedLoopError(f"decode job ended with status {status}")
            logits = runner.slot(calbin_fmt.DECODE).logits
            bf16_row = logits[0, 0]  # one token: the valid row is (1 - 1) % D0 = 0
            bf16_to_f32_into(bf16_row, 0, bf16_row.shape[0], self.row)
            self._token = int(np.argmax(self.row))
            self._done.set()

    # ---- the caller --------------------------------------------------------------------------
    def step(self, token: int, past: int) -> int:
        """One decode token through the three roles: the next greedy token."""
        self._done.clear()
        with self._submit_cv:
            self._work = (token, past)
            self._submit_cv.notify()
        if not self._done.wait(self.wait_s):
            raise ThreadedLoopError(f"no token within {self.wait_s:.0f} s (past={past})")
        if self._error is not None:
            raise ThreadedLoopError(self._error)
        return self._token

    def decode_block(self, prompt: np.ndarray, n: int) -> tuple[list[int], list[float]]:
        """As ``DirectLoop.decode_block``: the prefill on the calling thread (not timed),
        then ``n`` greedy decode tokens through the three roles. Returns (tokens, per-token
        wall time in us)."""
        runner = self.runner
        if self._error is not None:
            raise ThreadedLoopError(self._error)
        rc = runner.kv.release(self.seq_id)
        if rc != 0:
            raise ThreadedLoopError(f"KV release of seq {self.seq_id} returned {rc}")
        bf16_row = runner.run(calbin_fmt.PREFILL_IDS, self.seq_id, 0, tokens=prompt)
        bf16_to_f32_into(bf16_row, 0, bf16_row.shape[0], self.row)
        tokens, times = [int(np.argmax(self.row))], []
        clock = time.perf_counter_ns
        for past in range(len(prompt), len(prompt) + n):
            t0 = clock()
            token = self.step(tokens[-1], past)
            times.append((clock() - t0) / 1e3)
            tokens.append(token)
        return tokens, times

    def dma_violations(self) -> int:
        counters = self.runner.device.emu.counters()
        return int(counters["dma_input_violations"] + counters["dma_output_violations"])

    def close(self) -> None:
        """Stops both threads (bounded join), then closes the device."""
        for cv in (self._submit_cv, self._completion_cv):
            with cv:
                self._stopping = True
                cv.notify_all()
        for thread in self._threads:
            thread.join(self.wait_s)
        self.runner.close()
