"""The §13 acceptance gates, each a function ``(ctx, phase, progress) -> Gate``.

* ``correctness`` (§13.1): fixed prompts, greedy sequences through the executor vs the direct
  synchronous path (``bench.DirectLoop``) vs the numpy oracle; top-1 agreement, top-5 overlap
  and logits max_abs / max_rel / cosine of every delivered row against the FP32 oracle.
* ``lengths`` (§13.1): each input length prefilled and decoded; 40960 + decode and a 40961
  prefill refused by the bounds check before the device (``jobs_submitted`` unchanged).
* ``crosstalk`` (§13.1): two sequences alternating, both in flight at once where the phase
  allows; every token and the device KV length against each sequence's own oracle; in phase b
  under every overlap setting of the emulator (none / dma / full).
* ``injections`` (§13.2): cancels, deadlines and device faults mixed with a traffic client;
  every job resolves within a bound; at the end the golden passes or the lifecycle is Failed.
* ``soak`` (§13.2): traffic with cancels and periodic CCU faults for a duration; RSS, leased
  slots and queue depth sampled; no growth after warm-up; leased == 0 after shutdown;
  device CCU exceptions == injected ones.

Every successful token anywhere is checked against the oracle: a wrong token fails its gate.
"""

from __future__ import annotations

import random
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from calexec.contracts.status import Phase, Status
from calexec.contracts.types import TaskKind
from calexec.drivers.calrt.runtime import Fault, FaultMode, KvManager, Overlap, bundled_emulator
from calexec.drivers.device_spec import DeviceSpec
from calexec.drivers.synthetic import calbin as calbin_fmt
from calexec.drivers.synthetic import oracle
from calexec.drivers.tools.accept.gate_rig import (
    HANG_GRACE_S,
    JOB_S,
    Gate,
    Progress,
    growth,
    hung_status,
    leased,
    open_executor,
    request,
    rss_mib,
    run_job,
)
from calexec.drivers.tools.bench.core import DirectLoop

VOCAB = calbin_fmt.VOCAB
MAX_SEQ = calbin_fmt.MAX_SEQ
#: the latency profile of the phase-b crosstalk runs (us): H2D, decode compute, D2H, so the
#: overlap knob changes what actually runs at the same time
OVERLAP_PROFILE = {"h2d_us": 100, "decode_us": 300, "d2h_us": 100}


#: per-series cap of the job latencies kept for the report's plot
LATENCY_SAMPLE = 20_000


class LatencyReservoir:
    """A uniform random sample of at most ``capacity`` job latencies (Vitter's algorithm R)
    and how many were seen: constant memory however long the run. Keeping every latency made
    the soak's own bookkeeping grow RSS by ~32 bytes per job (72 MiB in a 30-minute soak of
    2.7 million jobs), which the soak gate then reported as the executor's growth."""

    def __init__(self, capacity: int = LATENCY_SAMPLE, seed: int = 0) -> None:
        self.capacity = capacity
        self.seen = 0
        self.values: list[float] = []
        self._rng = random.Random(seed)
        self._mu = threading.Lock()  # traffic threads record concurrently

    def add(self, value: float) -> None:
        with self._mu:
            self.seen += 1
            if len(self.values) < self.capacity:
                self.values.append(value)
            else:
                j = self._rng.randrange(self.seen)
                if j < self.capacity:
                    self.values[j] = value


@attrs.frozen
class AcceptContext:
    """What every gate needs: the calbin, its seed (the oracle's), the sizes, a seeded rng
    source, and where per-job latencies are sampled for the report's plot."""

    calbin_path: str
    seed: int
    sizes: Any  # calexec.drivers.tools.accept.run.Sizes
    #: the runtime library and manifest the gates open (default: the bundled emulator's)
    device: DeviceSpec = DeviceSpec()
    latencies_ms: dict[str, LatencyReservoir] = attrs.field(factory=dict)
    rss_series: dict[str, list[tuple[float, float]]] = attrs.field(factory=dict)

    def rng(self, salt: int) -> np.random.Generator:
        return np.random.default_rng([self.sizes.seed, salt])

    def record(self, series: str, result: Any) -> None:
        total = result.timings.total_ms()
        if total is None:
            return
        reservoir = self.latencies_ms.get(series)
        if reservoir is None:
            reservoir = self.latencies_ms.setdefault(series, LatencyReservoir(seed=self.seed))
        reservoir.add(total)


def _failed_start(name: str, metric: str, status: Status) -> Gate:
    return Gate(name, False, 0, metric, {"error": f"executor start failed: {status}"})


def _f32(bits: np.ndarray) -> np.ndarray:
    return oracle.bf16_to_f32(bits).astype(np.float64)


class _LogitStats:
    """Accumulates the §13.1 comparison of delivered FP32 rows with the FP32 oracle."""

    def __init__(self) -> None:
        self.rows = self.top1 = 0
        self.top5_overlap = 0.0
        self.max_abs = self.max_rel = 0.0
        self.min_cosine = 1.0

    def add(self, got: np.ndarray, want_bits: np.ndarray) -> None:
        want, got64 = _f32(want_bits), got.astype(np.float64)
        diff = np.abs(got64 - want)
        self.rows += 1
        self.top1 += int(np.argmax(got64) == np.argmax(want))
        top_got = set(np.argpartition(-got64, 5)[:5].tolist())
        top_want = set(np.argpartition(-want, 5)[:5].tolist())
        self.top5_overlap += len(top_got & top_want) / 5.0
        self.max_abs = max(self.max_abs, float(diff.max()))
        nz = np.abs(want) > 0
        if nz.any():
            self.max_rel = max(self.max_rel, float((diff[nz] / np.abs(want[nz])).max()))
        denom = float(np.linalg.norm(got64) * np.linalg.norm(want))
        self.min_cosine = min(self.min_cosine, float(got64 @ want) / denom if denom else 0.0)

    def summary(self) -> dict[str, Any]:
        n = max(self.rows, 1)
        return {"rows": self.rows, "top1_agreement": round(self.top1 / n, 6),
                "top5_overlap": round(self.top5_overlap / n, 6), "max_abs": self.max_abs,
                "max_rel": self.max_rel, "cosine_min": round(self.min_cosine, 9)}


def _greedy(ex, seq: int, prompt: np.ndarray, steps: int, ctx: AcceptContext, series: str,
            stats: _LogitStats | None = None) -> tuple[list[int], Status | None]:
    """Greedy prefill + ``steps`` decodes of a fresh ``seq``, every row checked against the
    oracle when ``stats`` is given. Returns (tokens, the first failure or None)."""
    # a job of ``seq`` the device still runs after a failed Wait: wait for it to let go
    status = ex.kvc.reset_sequence(seq, wait_s=RESET_WAIT_S)
    if not status.ok:
        return [], status
    ref = oracle.OracleSequence(ctx.seed)
    tile = ex.generation.submodels[TaskKind.PREFILL_IDS].logits_tile_d0
    req = request(seq, TaskKind.PREFILL_IDS, prompt, 0)
    tokens: list[int] = []
    for step in range(steps + 1):
        result = run_job(ex, req)
        if isinstance(result, Status):
            return tokens, result
        ctx.record(series, result)
        if stats is not None:
            if step == 0:
                want = ref.prefill(prompt.tolist(), tile)[0, oracle.valid_row(len(prompt), tile)]
            else:
                want = ref.decode(tokens[-1])[0, 0]
            stats.add(result.logits, want)
        tokens.append(result.argmax)
        req = request(seq, TaskKind.DECODE, [result.argmax], result.kv_len)
    return tokens, None


def _oracle_greedy(seed: int, prompt: np.ndarray, steps: int) -> list[int]:
    ref = oracle.OracleSequence(seed)
    ref.run(prompt.tolist())
    out = [ref.next_token()]
    for _ in range(steps):
        ref.run([out[-1]])
        out.append(ref.next_token())
    return out


# ---- §13.1 correctness -----------------------------------------------------------------------
def correctness(ctx: AcceptContext, phase: str, progress: Progress) -> Gate:
    name, metric = f"correctness_{phase}", "identical_fraction"
    sizes = ctx.sizes
    ex = open_executor(ctx.calbin_path, phase, device=ctx.device)
    if isinstance(ex, Status):
        return _failed_start(name, metric, ex)
    direct = DirectLoop(ctx.device.runtime(), ctx.calbin_path)
    rng = ctx.rng(1)
    stats = _LogitStats()
    identical = 0
    mismatches: list[dict[str, Any]] = []
    errors: list[str] = []
    try:
        for i in range(sizes.prompts):
            progress.update(name, i, sizes.prompts)
            prompt = rng.integers(0, VOCAB, int(rng.integers(1, sizes.max_prompt_len + 1)),
                                  dtype=np.int32)
            got, failure = _greedy(ex, 1, prompt, sizes.decode_steps, ctx, f"decode {phase}",
                                   stats)
            if failure is not None:
                errors.append(f"prompt {i}: {failure}")
                continue
            direct_tokens, _ = direct.decode_block(prompt, sizes.decode_steps)
            want = _oracle_greedy(ctx.seed, prompt, sizes.decode_steps)
            if got == direct_tokens == want:
                identical += 1
            elif len(mismatches) < 5:
                mismatches.append({"prompt": i, "executor": got, "direct": direct_tokens,
                                   "oracle": want})
        dma = direct.dma_violations()
    finally:
        direct.close()
        ex.shutdown()
    fraction = identical / sizes.prompts
    summary = stats.summary()
    passed = (fraction == 1.0 and not errors and summary["top1_agreement"] == 1.0
              and dma == 0)
    return Gate(name, passed, round(fraction, 6), metric, {
        "prompts": sizes.prompts, "decode_steps": sizes.decode_steps, **summary,
        "direct_dma_violations": dma, "errors": errors[:5], "mismatches": mismatches,
        "note": "the emulator computes BF16 logits exactly like the oracle, so top-1 1.0, "
                "top-5 1.0, max_abs/max_rel 0.0 and cosine 1.0 are the expected values"})


# ---- §13.1 lengths -------------------------------------------------------------------------------
def lengths(ctx: AcceptContext, phase: str, progress: Progress) -> Gate:
    name, metric = f"lengths_{phase}", "lengths_correct"
    sizes = ctx.sizes
    ex = open_executor(ctx.calbin_path, phase, device=ctx.device)
    if isinstance(ex, Status):
        return _failed_start(name, metric, ex)
    rng = ctx.rng(2)
    per_length: dict[int, Any] = {}
    try:
        for i, n in enumerate(sizes.lengths):
            progress.update(name, i, len(sizes.lengths) + 1)
            prompt = rng.integers(0, VOCAB, n, dtype=np.int32)
            stats = _LogitStats()
            steps = min(2, MAX_SEQ - n)  # 40959 leaves room for exactly one decode
            got, failure = _greedy(ex, 2, prompt, steps, ctx, f"prefill {phase}", stats)
            want = _oracle_greedy(ctx.seed, prompt, steps)
            per_length[n] = {"ok": failure is None and got == want and stats.top1 == stats.rows
                             and stats.max_abs == 0.0,
                             "tokens": got, "error": None if failure is None else str(failure)}
        progress.update(name, len(sizes.lengths), len(sizes.lengths) + 1)
        bounds = _bounds_check(ex, rng)
    finally:
        ex.shutdown()
    correct = sum(1 for v in per_length.values() if v["ok"])
    passed = correct == len(sizes.lengths) and bounds["ok"]
    return Gate(name, passed, correct, metric, {
        "lengths": list(sizes.lengths), "failed": {n: v for n, v in per_length.items()
                                                   if not v["ok"]},
        "bounds_check": bounds})


def _bounds_check(ex, rng: np.random.Generator) -> dict[str, Any]:
    """40960 prefilled, then a decode at past 40960 and a 40961-token prefill: both must be
    refused before the device (the emulator's jobs_submitted does not move)."""
    status = ex.kvc.reset_sequence(2)
    full = run_job(ex, request(2, TaskKind.PREFILL_IDS, rng.integers(0, VOCAB, MAX_SEQ,
                                                                       dtype=np.int32), 0))
    if not status.ok or isinstance(full, Status):
        return {"ok": False, "error": f"prefill of {MAX_SEQ} failed: {status if not status.ok else full}"}
    before = bundled_emulator(ex.device).counters()["jobs_submitted"]
    over_decode = run_job(ex, request(2, TaskKind.DECODE, [full.argmax], full.kv_len))
    ex.kvc.reset_sequence(3)
    over_prefill = run_job(ex, request(3, TaskKind.PREFILL_IDS,
                                       np.zeros(MAX_SEQ + 1, dtype=np.int32), 0))
    after = bundled_emulator(ex.device).counters()["jobs_submitted"]
    refused = [isinstance(r, Status) and r.code != "accept.hung"
               for r in (over_decode, over_prefill)]
    return {"ok": all(refused) and after == before, "jobs_submitted_delta": after - before,
            "decode_at_40960": str(over_decode) if isinstance(over_decode, Status) else "accepted",
            "prefill_40961": (str(over_prefill) if isinstance(over_prefill, Status)
                              else "accepted")}


# ---- §13.1 crosstalk -----------------------------------------------------------------------------
def crosstalk(ctx: AcceptContext, phase: str, progress: Progress) -> Gate:
    """Phase a: once with the device's default overlap. Phase b: once per overlap setting,
    with ``OVERLAP_PROFILE`` latencies so the two engines really run side by side."""
    name, metric = f"crosstalk_{phase}", "mismatches"
    settings = ("none", "dma", "full") if phase == "b" else ("full",)
    runs: dict[str, Any] = {}
    for k, setting in enumerate(settings):
        runs[setting] = _crosstalk_run(ctx, phase, setting, progress, name, k, len(settings))
    mismatches = sum(r.get("mismatches", 0) for r in runs.values())
    passed = all(r["ok"] for r in runs.values())
    return Gate(name, passed, mismatches, metric, {"tokens": ctx.sizes.crosstalk_tokens,
                                                   "overlap": runs})


def _crosstalk_run(ctx: AcceptContext, phase: str, setting: str, progress: Progress,
                   name: str, k: int, runs: int) -> dict[str, Any]:
    profile = "" if phase == "a" else ";".join(f"{key}={v}" for key, v in OVERLAP_PROFILE.items())
    ex = open_executor(ctx.calbin_path, phase, device_config=profile,
                       device=ctx.device)
    if isinstance(ex, Status):
        return {"ok": False, "error": f"executor start failed: {ex}"}
    rng = ctx.rng(3)
    seqs = (4, 5)
    total = ctx.sizes.crosstalk_tokens
    try:
        if bundled_emulator(ex.device).set_knob("overlap", int(Overlap[setting.upper()])) != 0:
            return {"ok": False, "error": f"set_knob(overlap={setting}) refused"}
        refs = {s: oracle.OracleSequence(ctx.seed) for s in seqs}
        last: dict[int, int] = {}
        past: dict[int, int] = {}
        errors: list[str] = []
        mismatches = 0
        kvc = ex.kvc
        if kvc is None:
            raise RuntimeError(f"the executor has no generation (lifecycle {ex.state})")
        for s in seqs:
            kvc.reset_sequence(s)
            prompt = rng.integers(0, VOCAB, 17 + s, dtype=np.int32)
            result = run_job(ex, request(s, TaskKind.PREFILL_IDS, prompt, 0))
            if isinstance(result, Status):
                return {"ok": False, "error": f"prefill of seq {s}: {result}"}
            refs[s].run(prompt.tolist())
            mismatches += result.argmax != refs[s].next_token()
            last[s], past[s] = result.argmax, result.kv_len
        done = 0
        while done < total and not errors:
            progress.update(name, k * total + done, runs * total)
            # both sequences' next decode enqueued before either is awaited: in phase b
            # both are in flight at once, on PING and PONG
            handles = {s: ex.enqueue(request(s, TaskKind.DECODE, [last[s]], past[s]))
                       for s in seqs[:min(2, total - done)]}
            for s, handle in handles.items():
                result = handle.wait_until(time.monotonic() + JOB_S + HANG_GRACE_S)
                if not handle.done:
                    result = hung_status(s)
                if isinstance(result, Status):
                    errors.append(f"seq {s} at past {past[s]}: {result}")
                    break
                ctx.record(f"decode {phase}", result)
                refs[s].run([last[s]])
                want_bits = oracle.logits_bf16(refs[s].states[-1])
                mismatches += (result.argmax != refs[s].next_token()
                               or not np.array_equal(result.logits, oracle.bf16_to_f32(want_bits)))
                last[s], past[s] = result.argmax, result.kv_len
                done += 1
        kv_manager = ex.kv
        if not isinstance(kv_manager, KvManager):  # (seq_len is this driver's, not the core's)
            raise TypeError(f"executor.kv={kv_manager!r:.200}: expected the cffi driver's "
                            "KvManager (its seq_len reads the device KV lengths)")
        kv = {s: kv_manager.seq_len(s)[1] for s in seqs}
        counters = bundled_emulator(ex.device).counters()
        snap = ex.snapshot()
    finally:
        ex.shutdown()
    kv_ok = all(kv[s] == refs[s].length for s in seqs)
    dma = counters["dma_input_violations"] + counters["dma_output_violations"]
    return {"ok": not errors and mismatches == 0 and kv_ok and dma == 0,
            "mismatches": int(mismatches), "kv_len": kv,
            "oracle_len": {s: refs[s].length for s in seqs}, "dma_violations": dma,
            "errors": errors, "inflight_capacity": snap.get("inflight_capacity"),
            "downgrades": snap.get("downgrades", 0), "profile_us": profile or "zero"}


# ---- §13.2 injections ----------------------------------------------------------------------------
#: (label, fault point, rc) of the device faults injected; None point: a request-side injection
FAULTS = (("ccu_exception", "CCU_EXCEPTION", 0), ("output_nan", "OUTPUT_NAN", 0),
          ("output_short", "OUTPUT_SHORT", 0), ("submit_busy", "SUBMIT_RC", 17),
          ("wait_timeout", "WAIT_RC", 13))
INJECTION_KINDS = ("cancel", "deadline") + tuple(label for label, _, _ in FAULTS)
#: per-job deadline under injections: far above a zero-latency job, short enough that a job
#: refused admission (e.g. no usable slot) costs the run little
INJECTION_JOB_S = 1.0
#: how long a gate waits for the device to let go of a sequence whose Wait failed before it
#: resets the sequence (machines/kv.py reset_sequence)
RESET_WAIT_S = 5.0
#: consecutive injections refused at admission while Ready before the gate stops (stuck)
STUCK_AFTER = 8


class _Traffic:
    """A client thread decoding greedily on its own sequence, checking every delivered token
    against the oracle; it restarts its sequence after any failure. Bounded waits only."""

    def __init__(self, ex, seq: int, seed: int, ctx: AcceptContext, series: str) -> None:
        self.ex, self.seq, self.seed, self.ctx, self.series = ex, seq, seed, ctx, series
        self.stop = threading.Event()
        self.ok = self.failed = self.wrong = self.hung = self.cancelled = 0
        self.cancel_every = 0
        self.thread = threading.Thread(target=self._run, name=f"accept-traffic-{seq}",
                                       daemon=True)

    def _run(self) -> None:
        ref, last, jobs = None, 0, 0
        while not self.stop.is_set():
            if ref is None:
                if self.ex.kvc is None or not self.ex.kvc.reset_sequence(
                        self.seq, wait_s=RESET_WAIT_S).ok:
                    time.sleep(0.002)  # recovering: no generation to talk to yet
                    continue
                ref = oracle.OracleSequence(self.seed)
                prompt = [(self.seq * 31 + i) % VOCAB for i in range(5)]
                req = request(self.seq, TaskKind.PREFILL_IDS, prompt, 0, INJECTION_JOB_S)
                tokens = prompt
            else:
                req = request(self.seq, TaskKind.DECODE, [last], ref.length, INJECTION_JOB_S)
                tokens = [last]
            jobs += 1
            handle = self.ex.enqueue(req)
            if self.cancel_every and jobs % self.cancel_every == 0:
                handle.cancel()
            result = handle.wait_until(req.deadline + HANG_GRACE_S)
            if not handle.done:
                self.hung += 1
                return
            if isinstance(result, Status):
                self.failed += 1
                self.cancelled += result.code.endswith("cancelled")
                ref = None
                time.sleep(0.001)
                continue
            self.ctx.record(self.series, result)
            ref.run(tokens)
            if result.argmax != ref.next_token():
                self.wrong += 1
            self.ok += 1
            last = result.argmax
            if ref.length > 2000:
                ref = None

    def __enter__(self) -> _Traffic:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(30.0)
        if self.thread.is_alive():
            self.hung += 1


def _wait_settled(ex, seconds: float) -> str:
    """Wait (bounded) until the lifecycle is Ready with no recovery pending, or final."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if ex.lifecycle.final or (ex.state == "Ready" and not ex.life.recovery_active):
            break
        time.sleep(0.002)
    return ex.state


def injections(ctx: AcceptContext, phase: str, progress: Progress) -> Gate:
    name, metric = f"injections_{phase}", "hung"
    n = ctx.sizes.injections
    policy = ctx.device.recovery(max_recoveries=n + 10, recovery_window_s=3600.0,
                                  drain_grace_s=2.0)
    ex = open_executor(ctx.calbin_path, phase, recovery=policy, device=ctx.device)
    if isinstance(ex, Status):
        return _failed_start(name, metric, ex)
    rng = ctx.rng(4)
    outcomes: dict[str, dict[str, int]] = {k: {} for k in INJECTION_KINDS}
    wrong = hung = 0
    ccu_injected = 0
    refused_in_a_row = 0
    stuck = None
    try:
        with _Traffic(ex, 9, ctx.seed, ctx, f"decode {phase}") as traffic:
            for i in range(n):
                progress.update(name, i, n)
                if _wait_settled(ex, 30.0) != "Ready":
                    break  # explicit Failed: the gate accepts it if it says why
                kind = INJECTION_KINDS[int(rng.integers(len(INJECTION_KINDS)))]
                result = _inject(ex, kind, rng, ctx.seed)
                bundled_emulator(ex.device).clear_all_faults()
                if kind == "ccu_exception":
                    # read after the clear (fired survives it; the next set resets it): the armed
                    # fault may have fired on a traffic job after the injected one returned
                    ccu_injected += bundled_emulator(ex.device).fault_stats(Fault.CCU_EXCEPTION)[2]
                if isinstance(result, Status):
                    key = result.code
                    hung += key == "accept.hung"
                else:
                    key = "ok"
                    wrong += result is False
                outcomes[kind][key] = outcomes[kind].get(key, 0) + 1
                # Ready but refusing every admission: neither serving nor explicitly Failed
                # (§13.2 accepts only those two); stop here instead of paying a deadline per
                # remaining injection
                refused_in_a_row = refused_in_a_row + 1 if key == "admission.deadline" else 0
                if refused_in_a_row >= STUCK_AFTER:
                    stuck = (f"{STUCK_AFTER} injections in a row refused admission while "
                             f"{ex.state} (slots {ex.snapshot()['slots']}); stopped after {i + 1}")
                    break
            final_state = _wait_settled(ex, 30.0)
        golden = None
        if final_state == "Ready":
            prompt = np.arange(1, 18, dtype=np.int32)
            tokens, failure = _greedy(ex, 1, prompt, 4, ctx, f"decode {phase}")
            golden = failure is None and tokens == _oracle_greedy(ctx.seed, prompt, 4)
        counters = bundled_emulator(ex.device).counters()
        snap = ex.snapshot()
        failure = ex.failure
    finally:
        shutdown = ex.shutdown(grace=5.0)
    hung += traffic.hung
    wrong += traffic.wrong
    ccu_unexplained = counters["ccu_exceptions"] - ccu_injected
    ends_ok = golden is True or (final_state == "Failed" and failure is not None)
    passed = (hung == 0 and wrong == 0 and ends_ok and ccu_unexplained == 0
              and stuck is None)
    return Gate(name, passed, hung, metric, {
        "injections": n, "stuck": stuck, "outcomes": outcomes, "wrong_tokens": wrong,
        "final_state": final_state, "golden_passed": golden,
        "failure": None if failure is None else str(failure),
        "recoveries": snap["recoveries"], "downgrades": snap.get("downgrades", 0),
        "inflight_capacity_end": snap.get("inflight_capacity"),
        "ccu_exceptions": counters["ccu_exceptions"], "ccu_injected": ccu_injected,
        "traffic": {"ok": traffic.ok, "failed": traffic.failed},
        "shutdown": str(shutdown)})


def _inject(ex, kind: str, rng: np.random.Generator, seed: int) -> Any:
    """One injection on seq 1 (fresh prefill, then the injected decode). Returns the
    decode's Status, True for a correct delivered token, False for a wrong one."""
    reset = (ex.kvc.reset_sequence(1, wait_s=RESET_WAIT_S) if ex.kvc is not None else
             Status.unavailable(Phase.RECOVERY, "no generation"))
    if not reset.ok:
        return Status.unavailable(Phase.RECOVERY, f"seq 1 could not be reset before the "
                                  f"injection: {reset}")
    prompt = rng.integers(0, VOCAB, 5, dtype=np.int32)
    first = run_job(ex, request(1, TaskKind.PREFILL_IDS, prompt, 0, INJECTION_JOB_S))
    if isinstance(first, Status):
        return first
    seconds = 1e-4 if kind == "deadline" else INJECTION_JOB_S
    label_point = {label: (point, rc) for label, point, rc in FAULTS}
    if kind in label_point:
        point, rc = label_point[kind]
        bundled_emulator(ex.device).set_fault(Fault[point], FaultMode.NTH, 1, 0, rc)
    req = request(1, TaskKind.DECODE, [first.argmax], first.kv_len, seconds=seconds)
    handle = ex.enqueue(req)
    if kind == "cancel":
        if rng.random() < 0.5:
            time.sleep(float(rng.random()) * 2e-4)
        handle.cancel()
    result = handle.wait_until(req.deadline + HANG_GRACE_S)
    if not handle.done:
        return hung_status(1)
    if isinstance(result, Status):
        return result
    ref = oracle.OracleSequence(seed)
    ref.run(prompt.tolist() + [first.argmax])
    return result.argmax == ref.next_token()


# ---- §13.2 soak ------------------------------------------------------------------------------------
def soak(ctx: AcceptContext, phase: str, progress: Progress) -> Gate:
    name, metric = f"soak_{phase}", "rss_growth_mib"
    sizes = ctx.sizes
    policy = ctx.device.recovery(max_recoveries=1_000_000, recovery_window_s=3600.0)
    ex = open_executor(ctx.calbin_path, phase, recovery=policy, device=ctx.device)
    if isinstance(ex, Status):
        return _failed_start(name, metric, ex)
    samples: dict[str, list[float]] = {"t": [], "rss_mib": [], "leased": [], "queued": []}
    ccu_injected = 0
    fault_times: list[float] = []
    pool = None
    try:
        clients = [_Traffic(ex, s, ctx.seed, ctx, f"soak {phase}") for s in (6, 7)]
        for c in clients:
            c.cancel_every = 50
            c.__enter__()
        # The first faults come early, inside the warm-up: each recovery retires a generation
        # whose host storage the executor keeps until the device proves no stale DMA into it
        # is pending (FI14); the allocator's high-water mark settles over the first few
        # recoveries, after which RSS must stay flat.
        ring = 4
        early_gap = min(sizes.soak_fault_every_s,
                        sizes.soak_seconds * sizes.soak_warmup_fraction / (ring + 2))
        try:
            t0 = time.monotonic()
            next_fault = t0 + early_gap
            while (now := time.monotonic()) < t0 + sizes.soak_seconds:
                progress.update(name, int(now - t0), int(sizes.soak_seconds))
                snap = ex.snapshot()
                samples["t"].append(now - t0)
                samples["rss_mib"].append(rss_mib())
                samples["leased"].append(leased(snap))
                samples["queued"].append(snap["queued"])
                if now >= next_fault and ex.state == "Ready":
                    ccu_injected += bundled_emulator(ex.device).fault_stats(Fault.CCU_EXCEPTION)[2]
                    bundled_emulator(ex.device).set_fault(Fault.CCU_EXCEPTION, FaultMode.NTH, 1, 0, 0)
                    fault_times.append(now - t0)
                    next_fault = now + (early_gap if len(fault_times) <= ring
                                        else sizes.soak_fault_every_s)
                time.sleep(sizes.soak_sample_s)
        finally:
            for c in clients:
                c.__exit__()
        _wait_settled(ex, 30.0)
        ccu_injected += bundled_emulator(ex.device).fault_stats(Fault.CCU_EXCEPTION)[2]
        counters = bundled_emulator(ex.device).counters()
        snap = ex.snapshot()
        pool = ex.pool
    finally:
        shutdown = ex.shutdown(grace=10.0)
    leased_after = None if pool is None else leased({"slots": pool.counts()})
    ctx.rss_series[phase] = list(zip(samples["t"], samples["rss_mib"]))
    # Warm-up also covers the first recoveries (the allocator's high-water mark settles).
    warmup = max(sizes.soak_warmup_fraction,
                 (fault_times[ring] / sizes.soak_seconds) if len(fault_times) > ring else 0.0)
    checks = {
        "rss_mib": growth(samples["t"], samples["rss_mib"], warmup,
                          max(8.0, 0.05 * max(samples["rss_mib"], default=0.0)), stat="median"),
        "leased": growth(samples["t"], samples["leased"], warmup, 1.0),
        "queued": growth(samples["t"], samples["queued"], warmup, 2.0),
    }
    ccu_unexplained = counters["ccu_exceptions"] - ccu_injected
    hung = sum(c.hung for c in clients)
    wrong = sum(c.wrong for c in clients)
    passed = (all(c["passed"] for c in checks.values()) and leased_after == 0
              and ccu_unexplained == 0 and hung == 0 and wrong == 0
              and snap["lifecycle"] == "Ready" and shutdown.ok)
    rss = checks["rss_mib"]
    value = round(rss.get("last_third_median", 0.0) - rss.get("first_third_median", 0.0), 3)
    return Gate(name, passed, value, metric, {
        "seconds": sizes.soak_seconds, "samples": len(samples["t"]),
        "warmup_fraction": round(warmup, 3), "growth": checks,
        "leased_after_shutdown": leased_after, "ccu_exceptions": counters["ccu_exceptions"],
        "ccu_injected": ccu_injected, "ccu_unexplained": ccu_unexplained,
        "jobs_ok": sum(c.ok for c in clients), "jobs_failed": sum(c.failed for c in clients),
        "cancelled": sum(c.cancelled for c in clients), "hung": hung, "wrong_tokens": wrong,
        "recoveries": snap["recoveries"], "downgrades": snap.get("downgrades", 0),
        "lifecycle_end": snap["lifecycle"], "shutdown": str(shutdown),
        "rule": "after warm-up (the larger of the configured fraction and the fifth fault), "
                "stat(last third) <= stat(first third) + slack for each series: median for "
                "RSS (recoveries swing single samples), max for leased and queued"})


def chaos(ctx: AcceptContext, phase: str, progress: Progress) -> Gate:
    """Issue 13's threaded fault soak of the reference server (``calexec.drivers.tools.chaos``):
    16 loopback clients while a seeded schedule injects every emulator fault kind, hung jobs
    and good/refused reloads, for ``chaos_seconds``; the gate passes when no rule broke
    (drivers/tools/chaos.py lists them). The server runs the bundled emulator's synthetic calbin."""
    name, metric = f"chaos_{phase}", "problems"
    try:
        from calexec.drivers.tools import chaos as soak_of_the_server
    except ImportError as exc:  # the [server] extra is missing
        return Gate(name, False, 0, metric, {"error": f"needs the [server] extra ({exc})"})
    with tempfile.TemporaryDirectory(prefix="calexec-chaos-") as tmp:
        figures = soak_of_the_server.run_chaos(
            Path(tmp), ctx.sizes.chaos_seconds, 16, 13 + ctx.sizes.seed,
            inflight_capacity=1 if phase == "a" else 2,
            progress=lambda done, total: progress.update(name, int(done), int(total)))
    problems, wrong = figures.pop("problems"), figures.pop("wrong")
    return Gate(name, not problems and not wrong, len(problems) + len(wrong), metric, {
        **figures, "wrong_tokens": len(wrong), "first_problems": problems[:5],
        "first_wrong": wrong[:5],
        "rule": "0 wrong tokens, 0 answers past deadline + slack, only documented statuses "
                "with JSON bodies, sequence ids conserved, nothing leased when idle, /ready "
                "back after each fault, drain ends Stopped"})


GATES: dict[str, Callable[[AcceptContext, str, Progress], Gate]] = {
    "correctness": correctness, "lengths": lengths, "crosstalk": crosstalk,
    "injections": injections, "soak": soak, "chaos": chaos}
