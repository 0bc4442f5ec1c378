"""Proofs the traceability audit of stop 59 found missing: spec items whose named tests passed
on code that broke them (docs/traceability.md, "Found at stop 59 (audit)").

Each test watches the runtime from outside the executor: the driver's classes are wrapped by
the test (``monkeypatch`` on ``calexec.drivers.calrt.runtime``), so a call the executor makes
from anywhere is seen, whatever the executor itself records.

* S07: every slot's runtime buffers are created and mapped once per generation, never per job.
* §5.2: no runtime call is made while the calling thread holds ``admission_mu``, ``pool_mu``,
  ``submit_mu`` or ``completion_mu``; ``Wait()`` is called holding no executor lock at all
  (``recovery_mu`` aside: only a recovery, which drives the call itself, holds it).
* S09: the executor reads the valid row of a prefill output tile by the manifest's
  ``logits_tile_d0``: a calbin of D0 = 8 answers the oracle's logits.
* S10: completing a job (Wait, output check, the slice converted into the caller's row, KV
  commit, release) allocates no numpy data buffer, on the fused native path and the numpy one.
* S12: a dump directory under the user's own ``$HOME`` is refused wherever that home is.
"""

from __future__ import annotations

import collections
import hashlib
import threading
from pathlib import Path

import numpy as np
import pytest

from calexec.contracts.errors import Category
from calexec.contracts.manifest import default_manifest_path, load_manifest
from calexec.contracts.status import Phase, Status
from calexec.drivers.alloccount import count
from calexec.drivers.calrt.runtime import CalRT, Device, InputBuf, KvManager, Model, OutputBuf
from calexec.drivers.serving.dumpsink import DumpConfigError, DumpSink
from calexec.drivers.synthetic import calbin as cb
from calexec.drivers.synthetic import oracle
from calexec.machines.executor import DeviceExecutor, ExecutorConfig
from calexec.machines.job import InferenceResult
from calexec.machines.postprocess import bf16_all_finite
from executor_harness import (
    MANIFEST,
    SEED,
    arm,
    deadline,
    decode,
    expected_greedy,
    greedy,
    oracle_golden,
    prefill,
    running_executor,
    settle,
    until,
    write_calbin,
)

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
STEPS = 12


@pytest.fixture(scope="module")
def calbin(tmp_path_factory):
    return write_calbin(tmp_path_factory.mktemp("proofs"))


def wrap(monkeypatch, cls, name, before):
    """Replace ``cls.name`` by a call of ``before(self, *args)`` then the real method."""
    real = getattr(cls, name)

    def recorded(self, *args, **kwargs):
        before(self, *args)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(cls, name, recorded)


def run_loops(ex, seqs, steps: int = STEPS) -> dict[int, list[int]]:
    """Greedy loops of ``seqs`` on caller threads at once (bounded joins); their tokens."""
    out: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def loop(seq):
        try:
            out[seq] = greedy(ex, seq, PROMPT, steps)
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=loop, args=(seq,), name=f"proof-seq{seq}")
               for seq in seqs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not any(t.is_alive() for t in threads) and errors == [], errors
    return out


# ---- S07: runtime buffers per generation, not per job --------------------------------------------
def test_runtime_buffers_are_created_and_mapped_once_per_generation_never_per_job(
        calbin, monkeypatch):
    """The driver counts ``Model.create_input_buf`` / ``create_output_buf``, every ``map`` and
    ``destroy`` of an input or output buffer. Start: one of each per slot (three tensors
    mapped per slot). Then many jobs of three sequences at once: not one more call. A
    recovery's new generation creates and maps its own once (the count is the generation's,
    not a constant), and the old generation's are destroyed. Before this test the row named
    only tests that count slots and host addresses: a pool creating, mapping and destroying
    runtime buffers for every job (legacy S07) passed them all."""
    calls: collections.Counter[str] = collections.Counter()
    for cls, names in ((Model, ("create_input_buf", "create_output_buf")),
                       (InputBuf, ("map", "destroy")), (OutputBuf, ("map", "destroy"))):
        for name in names:
            wrap(monkeypatch, cls, name,
                 lambda self, *args, key=f"{cls.__name__}.{name}": calls.update([key]))
    with running_executor(calbin) as ex:
        slots = len(ex.pool.slots)
        per_generation = {"Model.create_input_buf": slots, "Model.create_output_buf": slots,
                          "InputBuf.map": 2 * slots, "OutputBuf.map": slots}
        assert dict(calls) == per_generation
        submitted = ex.device.emu.counters()["jobs_submitted"]
        assert run_loops(ex, (1, 2, 3)) == {seq: expected_greedy(PROMPT, STEPS)
                                            for seq in (1, 2, 3)}
        jobs = ex.device.emu.counters()["jobs_submitted"] - submitted
        assert jobs >= 3 * (STEPS + 1) > slots  # every slot served several jobs
        assert dict(calls) == per_generation, "runtime buffers created or mapped per job"
        old_pool = ex.pool
        assert ex.recover(Status.failure("test.recover", Category.DEVICE, Phase.RECOVERY,
                                         "test")).ok
        assert ex.gen.id == 2 and ex.pool is not old_pool
        assert {k: calls[k] for k in per_generation} == {k: 2 * v for k, v in
                                                         per_generation.items()}
        assert calls["InputBuf.destroy"] == calls["OutputBuf.destroy"] == slots


# ---- §5.2: no executor lock held at a runtime call --------------------------------------------
NEVER_AT_A_RUNTIME_CALL = {"admission_mu", "pool_mu", "submit_mu", "completion_mu"}


def test_no_executor_lock_is_held_at_a_runtime_call_nor_any_across_wait(calbin, monkeypatch):
    """Every ``infer``, ``Wait``, ``GetStatus``, ``SetCsr``, ``SliceTensor``, ``UndoSlice``,
    ``canAllocate`` and ``Apply`` the executor makes (plain loops, a decode stream, a fault and
    its recovery) is checked, at the call, against the locks the calling thread holds
    (``ex.locks.held_by_current_thread()``): none of admission/pool/submit/completion, and
    none at all but ``recovery_mu`` at ``Wait``. The row named the executor's own check,
    which ``Completion._complete`` runs before it calls ``Wait``: a ``Wait`` moved under
    ``completion_mu`` passed every named test. The buffers' ``MapBuf`` and ``destroy`` (a
    generation's pool opened at start and recovery, its quarantined slots retired after the
    reset) are checked too: a mutant destroying the retired slots' buffers inside
    ``pool_mu`` (``BufferPool.retire_quarantined``) passed this test before (stop 67, trace
    audit)."""
    holder: dict[str, DeviceExecutor] = {}
    bad: list[tuple[str, str, tuple[str, ...]]] = []
    seen: collections.Counter[str] = collections.Counter()

    def check(call):
        def before(self, *args):
            ex = holder.get("ex")
            if ex is None:
                return
            held = ex.locks.held_by_current_thread()
            seen[call] += 1
            forbidden = (set(held) - {"recovery_mu"} if call == "OutputBuf.wait"
                         else set(held) & NEVER_AT_A_RUNTIME_CALL)
            if forbidden:
                bad.append((call, threading.current_thread().name, held))
        return before

    for cls, names in ((Device, ("infer", "infer_with_fixed_task_type")),
                       (OutputBuf, ("wait", "get_status", "map", "destroy")),
                       (InputBuf, ("set_csr", "slice", "undo_slice", "map", "destroy")),
                       (KvManager, ("can_allocate", "apply"))):
        for name in names:
            wrap(monkeypatch, cls, name, check(f"{cls.__name__}.{name}"))
    ex = DeviceExecutor(CalRT.load(), MANIFEST, ExecutorConfig(
        calbin_path=calbin, check_lock_order=True, strict_lock_order=False))
    holder["ex"] = ex  # from the start: the golden run's calls are checked too
    try:
        assert ex.start().ok
        run_loops(ex, (1, 2))
        result = ex.enqueue(prefill(3, PROMPT, kv_reserve_len=len(PROMPT) + 4)).wait_until(
            deadline())
        assert isinstance(result, InferenceResult), result
        with ex.decode_stream(3, result.kv_len, deadline(), max_len=len(PROMPT) + 4) as stream:
            token = result.argmax
            for _ in range(3):
                step = stream.step(token)
                assert isinstance(step, InferenceResult), step
                token = step.argmax
        arm(ex, "CCU_EXCEPTION")  # a fault after submit: quarantine, drain, reset, golden
        failed = ex.enqueue(prefill(4, PROMPT)).wait_until(deadline())
        assert isinstance(failed, Status)
        until(lambda: ex.state == "Ready" and ex.gen.id == 2, 10, "the recovery")
        assert greedy(ex, 1, PROMPT, 2) == expected_greedy(PROMPT, 2)
        settle(ex)
    finally:
        ex.shutdown(grace=5.0)
    for call in ("Device.infer", "OutputBuf.wait", "OutputBuf.get_status", "InputBuf.set_csr",
                 "InputBuf.slice", "InputBuf.undo_slice", "KvManager.can_allocate",
                 "KvManager.apply", "InputBuf.map", "OutputBuf.map", "InputBuf.destroy",
                 "OutputBuf.destroy"):
        assert seen[call] > 0, f"{call} never called: the check saw nothing"
    assert bad == [], bad[:5]


# ---- S09: the valid row by the manifest's logits_tile_d0 ---------------------------------------
TILE_D0 = 8


def tile_manifest(directory: Path, tile_d0: int) -> Path:
    """The bundled manifest with its prefill graphs' output tile at ``tile_d0`` rows."""
    text = default_manifest_path().read_text()
    vocab = cb.VOCAB
    text = text.replace("logits_tile_d0 = 16", f"logits_tile_d0 = {tile_d0}").replace(
        f'shape = [1, 16, {vocab}], dtype = "BF16", byte_size = {16 * vocab * 2}',
        f'shape = [1, {tile_d0}, {vocab}], dtype = "BF16", byte_size = {tile_d0 * vocab * 2}')
    assert text.count(f"logits_tile_d0 = {tile_d0}") == 2
    path = directory / "tile.toml"
    path.write_text(text)
    return path


def test_the_executor_reads_the_valid_row_of_a_prefill_tile_of_the_manifests_d0(tmp_path):
    """A calbin whose prefill output tile has 8 rows (its manifest says so, the graph metadata
    agrees): every prompt length's logits row is the oracle's, tokens too, for lengths
    whose last row differs between D0 = 8 and D0 = 16 (9 ... 16, 25). The row named the unit
    test of ``valid_logits_row`` and the emulator's tile, both with D0 as an argument: an
    executor reading the row of a hard-coded D0 = 16 (legacy S09) passed them."""
    path = tmp_path / "tile8.calbin"
    cb.write(str(path), cb.default_spec(tile_d0=TILE_D0))
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    manifest = load_manifest(tile_manifest(tmp_path, TILE_D0))
    config = ExecutorConfig(calbin_path=str(path), goldens={sha: oracle_golden(SEED)})
    ex = DeviceExecutor(CalRT.load(), manifest, config)
    try:
        assert ex.start().ok  # the golden: the oracle's tokens
        for seq, n in enumerate((1, 7, 8, 9, 12, 16, 17, 25), start=1):
            tokens = [(i * 2654435761 + seq * 97) % cb.VOCAB for i in range(n)]
            row = np.full(ex.generation.vocab_size, np.nan, np.float32)
            result = ex.enqueue(prefill(seq, tokens), logits_out=row).wait_until(deadline())
            assert isinstance(result, InferenceResult), result
            tile = oracle.OracleSequence(SEED).prefill(tokens, TILE_D0)
            expected = oracle.bf16_to_f32(tile[0, oracle.valid_row(n, TILE_D0)])
            assert np.array_equal(row, expected), f"prompt of {n}: not the oracle's row"
            assert result.argmax == expected_greedy(tokens, 0)[0]
            assert ex.release_sequence(seq, 5.0).ok
    finally:
        ex.shutdown(grace=5.0)


# ---- S12: the user's own home, wherever it is -----------------------------------------------
def test_a_dump_dir_under_the_users_home_is_refused_wherever_home_is(tmp_path, monkeypatch):
    """``$HOME`` outside /home and /root (a service account's, a CI runner's): a dump
    directory in it or under it is refused, naming it, unless ``allow_home``; a directory
    beside it is taken. The row named a test of /home and /root only (the test host's HOME
    is /root): a sink refusing those two alone passed it."""
    home = tmp_path / "svc-home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for directory in (home, home / "dumps", home / "a" / "b"):
        with pytest.raises(DumpConfigError, match="home"):
            DumpSink(directory, max_bytes=1000)
    allowed = DumpSink(home / "dumps", max_bytes=1000, allow_home=True)
    assert allowed.write({"n": 1}) and allowed.records == 1
    beside = DumpSink(tmp_path / "dumps", max_bytes=1000)
    assert beside.write({"n": 1}) and beside.records == 1


# ---- S10: no temporary of the vocabulary per job ------------------------------------------------
@pytest.mark.parametrize("path", ["fused", "numpy"])
def test_completing_a_job_allocates_no_numpy_buffer(calbin, path):
    """Stepped executor: the test thread runs each job's completion (``complete_one``), its
    numpy data allocations counted (drivers/alloccount.py, the calling thread's) for prefills
    and decodes into the caller's row: 0 on the fused native pass; on the numpy fallback (a
    runtime without it) only the 0-d results of its finiteness check and argmax; the
    oracle's tokens. The row named unit tests of
    the conversion functions: a completion that also widened the whole BF16 output into a
    temporary FP32 vector each job (legacy S10) passed them."""
    with running_executor(calbin, threads=False) as ex:
        if path == "numpy":
            ex.completion.fused_logits = None  # as test_native_logits.py: the numpy path
        row = np.empty(ex.generation.vocab_size, np.float32)
        allocations = []

        def job(request):
            handle = ex.enqueue(request, logits_out=row)
            assert ex.submit_one()
            allocations.append(count(lambda: ex.complete_one(block=True), 1, warmup=0).numpy_data)
            result = handle.wait_until(deadline())
            assert isinstance(result, InferenceResult), result
            return result

        result = job(prefill(1, PROMPT))
        tokens = [result.argmax]
        for _ in range(4):
            result = job(decode(1, tokens[-1], result.kv_len))
            tokens.append(result.argmax)
        assert tokens == expected_greedy(PROMPT, 4)
        job(prefill(2, list(range(1, 20))))  # a second row of the prefill tile
        floor = 0.0
        if path == "numpy":
            # what the numpy path's own check and argmax allocate (their 0-d results), measured
            # on a row of the same size: nothing of the row's size may come on top
            bits = np.zeros(row.shape[0], np.uint16)
            scratch = np.empty_like(bits)
            floor = count(lambda: (bf16_all_finite(bits, scratch), int(np.argmax(row))),
                          1).numpy_data
            assert floor <= 2
        assert allocations == [floor] * 6, (allocations, floor)
