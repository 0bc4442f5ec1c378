"""Shared pieces of the §13 acceptance gates: the gate result, the executor rig of one phase,
request builders, the progress bar and the growth test of the soak.

Phase ``a`` is in-flight capacity 1 (``infer``); phase ``b`` is capacity 2 with each buffer slot
fixed to PING or PONG (``infer_with_fixed_task_type``, parallel mode on). Every wait here is
bounded: a job that does not resolve by its deadline plus ``HANG_GRACE_S`` counts as hung.
"""

from __future__ import annotations

import hashlib
import io
import shlex
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TextIO

import attrs
import numpy as np

from calexec.contracts.errors import Category
from calexec.contracts.goldens import goldens_path
from calexec.contracts.goldens import lookup as lookup_golden
from calexec.contracts.prepare import InferenceRequest
from calexec.contracts.status import Phase, Status
from calexec.contracts.types import TaskKind
from calexec.drivers.device_spec import DeviceSpec
from calexec.drivers.memory import rss_bytes
from calexec.machines.executor import DeviceExecutor, ExecutorConfig
from calexec.machines.faults import RecoveryPolicy

PHASE_CAPACITY = {"a": 1, "b": 2}
JOB_S = 10.0  # per-job deadline; a zero-latency job finishes in well under a millisecond
HANG_GRACE_S = 5.0  # beyond the job's deadline: the job is hung


@attrs.frozen
class Gate:
    """One acceptance gate's verdict: ``value`` is the measured figure named by ``metric``."""

    name: str
    passed: bool
    value: float | int
    metric: str
    details: dict[str, Any] = attrs.field(factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "value": self.value, "metric": self.metric,
                "details": self.details}


class Progress:
    """Progress of the gates on a stream (stderr by default).

    On a terminal: a tqdm bar (tqdm comes with the ``[plots]`` extra; without it a plain
    carriage-return bar). Elsewhere (a log file, a CI pipe): one plain line at most every
    ``every_s`` seconds and one when a gate ends, never a carriage return."""

    def __init__(self, total_gates: int, stream: TextIO | None = None, width: int = 24,
                 every_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.total = max(1, total_gates)
        self.done = 0
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.every_s = every_s
        self.clock = clock
        isatty = getattr(self.stream, "isatty", None)
        self.tty = bool(isatty and isatty())
        self._last: float | None = None
        self._gate = ""
        self._bar: Any = None
        if self.tty:
            try:
                from tqdm import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self._bar = tqdm(total=1000, file=self.stream, unit="‰", leave=True,
                                 bar_format="{l_bar}{bar}| {elapsed}<{remaining}")

    def _fraction(self, step: int, steps: int) -> float:
        return min(1.0, (self.done + (step / steps if steps else 1.0)) / self.total)

    def update(self, gate: str, step: int, steps: int) -> None:
        frac = self._fraction(step, steps)
        self._gate = gate
        if self._bar is not None:
            self._bar.set_description(f"{gate} {step}/{steps}", refresh=False)
            self._bar.update(int(frac * 1000) - self._bar.n)
        elif self.tty:
            fill = int(round(frac * self.width))
            self.stream.write(f"\r[{'#' * fill}{'.' * (self.width - fill)}] {frac * 100:5.1f}% "
                              f"{gate} {step}/{steps}   ")
            self.stream.flush()
        else:
            now = self.clock()
            if self._last is None or now - self._last >= self.every_s:
                self._last = now
                self._line(f"{frac * 100:5.1f}% {gate} {step}/{steps}")

    def _line(self, text: str) -> None:
        self.stream.write(f"[accept] {text}\n")
        self.stream.flush()

    def gate_done(self) -> None:
        self.done += 1
        if not self.tty:
            self._line(f"{self.done * 100 / self.total:5.1f}% {self._gate or 'gate'} done "
                       f"({self.done}/{self.total} gates)")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self.tty:
            self.stream.write("\n")
            self.stream.flush()


class Silent(Progress):
    """No output (the Python API's default)."""

    def __init__(self, total_gates: int = 0) -> None:
        super().__init__(total_gates, stream=io.StringIO())

    def update(self, gate: str, step: int, steps: int) -> None:
        pass

    def gate_done(self) -> None:
        self.done += 1

    def close(self) -> None:
        pass


def request(seq: int, kind: TaskKind, tokens: Sequence[int] | np.ndarray, past: int,
            seconds: float = JOB_S) -> InferenceRequest:
    tokens = np.asarray(tokens, dtype=np.int32)
    return InferenceRequest(seq_id=seq, kind=kind, tokens=tokens,
                            positions=np.arange(past, past + len(tokens), dtype=np.int32),
                            past_len=past, deadline=time.monotonic() + seconds)


def open_executor(calbin_path: str, phase: str, recovery: RecoveryPolicy | None = None,
                  device_config: str = "", device: DeviceSpec = DeviceSpec()
                  ) -> DeviceExecutor | Status:
    """A started executor of ``phase`` on its own device of ``device``'s runtime (default:
    the bundled emulator) with ``device``'s manifest, or the start Status."""
    if phase not in PHASE_CAPACITY:
        raise ValueError(f"phase must be one of {sorted(PHASE_CAPACITY)}, got {phase!r}")
    config = ExecutorConfig(calbin_path=calbin_path, device_config=device_config,
                            inflight_capacity=PHASE_CAPACITY[phase],
                            recovery=recovery or device.recovery())
    ex = DeviceExecutor(device.runtime(), device.manifest(), config)
    status = ex.start()
    return ex if status.ok else status


def unpinned_golden(calbin_path: str, device: DeviceSpec = DeviceSpec()) -> str | None:
    """Why no gate's executor can start on ``calbin_path`` with ``device``'s manifest: no
    golden is pinned next to it for this calbin and the warm-up every gate runs (§9.2; the
    start would end ``golden.unpinned``), in one line naming the flag that chose it; None
    when one is. Found before the run: each gate would otherwise fail on the same start
    and the run read as gates the executor failed (exit 1)."""
    config = ExecutorConfig(calbin_path=calbin_path)
    manifest = device.manifest()
    try:
        with open(calbin_path, "rb") as f:
            sha = hashlib.sha256(f.read()).hexdigest()
    except OSError:  # (read a moment ago: the start will say what became of it)
        return None
    if lookup_golden(manifest.goldens, sha, config.golden_tokens,
                     config.golden_decode_steps) is not None:
        return None
    where = goldens_path(manifest.source)
    # the flags of the command that pins it, as typed (shell-quoted): the manifest whose goldens
    # file the gates read, the runtime whose golden it is
    flags = "".join(f" {flag} {shlex.quote(value)}" for flag, value in (
        ("--manifest", device.manifest_path), ("--runtime-lib", device.library))
        if value is not None)
    if device.calbin_path is not None:
        return (f"--calbin={device.calbin_path!r}: no golden is pinned for it (sha256 {sha}) "
                f"in {where}, so no gate's executor can start; run `calexec golden record "
                f"--calbin {shlex.quote(device.calbin_path)}{flags}` first")
    given = "the packaged manifest" if device.manifest_path is None else \
        f"--manifest={device.manifest_path!r}"
    return (f"{given}: {where} pins no golden for the synthetic calbin (sha256 {sha}), so no "
            "gate's executor can start; run `calexec sim write-calbin PATH` and `calexec "
            f"golden record --calbin PATH{flags}` first")


def run_job(ex: DeviceExecutor, req: InferenceRequest) -> Any:
    """Enqueue and wait (bounded). Returns the InferenceResult or a Status; a job still
    unresolved after its deadline plus ``HANG_GRACE_S`` returns a ``Status`` whose code is
    ``accept.hung``."""
    handle = ex.enqueue(req)
    result = handle.wait_until(req.deadline + HANG_GRACE_S)
    if not handle.done:
        return hung_status(req.seq_id)
    return result


def hung_status(seq: int) -> Status:
    return Status.failure("accept.hung", Category.INTERNAL, Phase.WAIT,
                          f"job of seq {seq} unresolved past its deadline + {HANG_GRACE_S}s")


def leased(snapshot: Mapping[str, Any]) -> int:  # an ExecutorSnapshot too
    """Slots currently out of the pool (Leased or InFlight) in an executor snapshot."""
    slots = snapshot.get("slots") or {}
    return int(slots.get("Leased", 0) + slots.get("InFlight", 0))


def rss_mib() -> float:
    """Resident set size of this process in MiB."""
    return rss_bytes() / (1 << 20)


def growth(times: Sequence[float], values: Sequence[float], warmup_fraction: float,
           slack: float, stat: str = "max") -> dict[str, Any]:
    """The soak's no-monotonic-growth test of one sampled series.

    Samples before ``warmup_fraction`` of the run are ignored; the rest is cut in thirds and
    the series passes when ``stat(last third) <= stat(first third) + slack``. ``stat`` is
    ``max`` for counts (leased slots, queue depth: one high sample is the finding) or
    ``median`` for RSS: every recovery allocates the next generation's buffers (~40 MiB of
    mapped logits rows) before the retired one is freed on proof, so single samples swing by
    tens of MiB with no trend, while a leak moves the median of a third. The least-squares
    slope over the post-warm-up samples (per hour) is reported alongside, not gated: a short
    run's slope extrapolates noise."""
    t = np.asarray(times, dtype=np.float64)
    v = np.asarray(values, dtype=np.float64)
    if len(t) == 0:
        return {"passed": False, "reason": "no samples"}
    keep = t >= t[0] + warmup_fraction * (t[-1] - t[0])
    t, v = t[keep], v[keep]
    if len(v) < 3:
        return {"passed": False, "reason": f"only {len(v)} samples after warm-up"}
    if stat not in ("max", "median"):
        raise ValueError(f"stat={stat!r}: one of 'max', 'median'")
    third = len(v) // 3
    of = np.max if stat == "max" else np.median
    first, last = float(of(v[:third])), float(of(v[-third:]))
    slope = float(np.polyfit(t - t[0], v, 1)[0]) * 3600.0 if np.ptp(t) > 0 else 0.0
    return {"passed": last <= first + slack, "stat": stat,
            f"first_third_{stat}": round(first, 3), f"last_third_{stat}": round(last, 3),
            "first_third_max": round(float(v[:third].max()), 3),
            "last_third_max": round(float(v[-third:].max()), 3),
            "slack": slack, "samples": int(len(v)), "slope_per_hour": round(slope, 3)}
