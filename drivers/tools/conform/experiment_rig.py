"""The experiment rig: one device of any calrt.h library, the synthetic calbin, buffer slots.

Used only inside an experiment's child process (``isolate.py``). A failing runtime call
raises ``DriverError`` carrying the raw CalRT code; the child boundary turns it into an
``inconclusive`` answer naming the call and the code, so the runner itself never fails
because the runtime did.

``build_emulator_lib`` produces ``libcalrt_emu.so`` with the project's Makefile so the
bundled emulator is exercised through ``ffi.dlopen``, exactly like a vendor shim.
"""

from __future__ import annotations

import os
import time

import numpy as np

from calexec.drivers import calrt as calrt_pkg
from calexec.drivers.calrt.runtime import CalRT, JobStatus
from calexec.drivers.direct import DriverError, check, open_configured
from calexec.drivers.synthetic import calbin as calbin_fmt
from calexec.drivers.synthetic import oracle
from calexec.drivers.tools.bench.subproc import run_group

CANARY = 0xFFFF  # BF16 NaN bits: the synthetic model never produces them
FINAL_STATUSES = (JobStatus.DONE, JobStatus.DONE_CCU_EXCEPTION, JobStatus.ABORTED)
WAIT_CAP_US = 5_000_000  # no experiment waits longer than this for one job


def build_emulator_lib(out_dir: str) -> str:
    """Build libcalrt_emu.so into out_dir with drivers/calrt/Makefile; returns its path.
    Raises RuntimeError with the compiler output when the build fails."""
    here = os.path.dirname(os.path.abspath(calrt_pkg.__file__))  # drivers/calrt: Makefile + C
    # (in a process group of its own, ended whole on an interrupt: the compiler ran on)
    proc = run_group(["make", "-s", "-C", here, "lib", f"O={out_dir}"])
    path = os.path.join(out_dir, "libcalrt_emu.so")
    if proc.returncode != 0 or not os.path.exists(path):
        raise RuntimeError(f"building libcalrt_emu.so failed (make exit {proc.returncode}): {proc.stderr[-2000:]}")
    return path


def tokens_for(seq: int, n: int, salt: int = 0) -> list[int]:
    """Deterministic pseudo-random tokens of a sequence."""
    return [(seq * 7919 + i * 104729 + salt * 15485863 + 1) % calbin_fmt.VOCAB for i in range(n)]


def expected_row(ref: oracle.OracleSequence, tokens: list[int], past: int) -> np.ndarray:
    """Advance the oracle by a job and return the logits row of its last token."""
    chain = ref.run(tokens, past)
    return oracle.logits_bf16(chain[-1], ref.vocab, ref.salt)


class Slot:
    """InputBuf + OutputBuf of one model with mapped host arrays (never moved)."""

    def __init__(self, model) -> None:
        info = model.info
        self.model = model
        self.name = info.name
        rc, self.inbuf = model.create_input_buf()
        check(rc, f"{self.name}: inputbuf_create")
        rc, self.outbuf = model.create_output_buf()
        check(rc, f"{self.name}: outputbuf_create")
        self.inputs = {}
        for t in info.inputs:
            arr = np.zeros(t.shape, dtype=np.int32 if t.dtype == "S32" else np.uint16)
            check(self.inbuf.map(t.name, arr), f"{self.name}: map {t.name}")
            self.inputs[t.name] = arr
        out = info.outputs[0]
        self.logits = np.full(out.shape, CANARY, dtype=np.uint16)
        check(self.outbuf.map(out.name, self.logits), f"{self.name}: map {out.name}")
        self.sliceable = [t.name for t in info.inputs if t.sliceable]
        self.n = 0

    def fill(self, tokens: list[int], past: int) -> None:
        """Write the host inputs of a job (the device reads them at H2D)."""
        n = len(tokens)
        self.inputs["input_ids"][0, :n] = tokens
        self.inputs["positions"][0, :n] = np.arange(past, past + n, dtype=np.int32)

    def set_meta(self, n: int, past: int) -> None:
        """Slices and CSRs of a job of n tokens at past (metadata only, no host memory)."""
        for t in self.sliceable:
            check(self.inbuf.slice(t, 0, n), f"{self.name}: slice {t}")
        check(self.inbuf.set_csr("cur_seq_len", n), f"{self.name}: set_csr cur_seq_len")
        check(self.inbuf.set_csr("total_seq_len", past + n), f"{self.name}: set_csr total_seq_len")
        self.n = n

    def last_row(self) -> np.ndarray:
        """The output row of the job's last token (a view of the mapped host output)."""
        return self.logits[0, (self.n - 1) % self.logits.shape[1]]

    def arm_canary(self) -> None:
        self.logits.fill(CANARY)

    def canary_intact(self) -> bool:
        return bool(np.all(self.logits == CANARY))

    def wait(self, timeout_us: int = WAIT_CAP_US) -> tuple[int, int]:
        """(Wait's code, the job status afterwards)."""
        rc = self.outbuf.wait(timeout_us)
        src, status = self.outbuf.get_status()
        return rc, (status if src == 0 else -src)


class Rig:
    """A configured device with its KV manager, in parallel mode when the library allows."""

    def __init__(self, lib_path: str, calbin_path: str, config: str = "") -> None:
        self.rt = CalRT.load(lib_path)
        self.config = config
        self.device, self.calbin, self.kv, self.models = open_configured(self.rt, calbin_path,
                                                                         config)
        self.emu = self.device.emu
        self.seed = calbin_fmt.read(calbin_path).seed
        self.parallel_rc = self.device.enable_parallel_mode(True)
        self._probe: Slot | None = None

    def slot(self, name: str = calbin_fmt.DECODE) -> Slot:
        return Slot(self.models[name])

    def oracle(self) -> oracle.OracleSequence:
        return oracle.OracleSequence(self.seed)

    def submit(self, slot: Slot, seq: int, past: int, tokens: list[int], engine: int | None = None) -> int:
        """Fill, set metadata, Apply KV and infer; returns infer()'s code (Apply failure raises)."""
        slot.fill(tokens, past)
        slot.set_meta(len(tokens), past)
        if not self.kv.apply(seq, past + len(tokens)):
            raise DriverError(f"kv apply(seq={seq}, target={past + len(tokens)})", 0)
        return self.infer(slot, seq, engine)

    def infer(self, slot: Slot, seq: int, engine: int | None = None) -> int:
        if engine is None:
            return self.device.infer(slot.model, self.kv, seq, slot.inbuf, slot.outbuf)
        return self.device.infer_with_fixed_task_type(slot.model, self.kv, seq, slot.inbuf, slot.outbuf, engine)

    def run(self, slot: Slot, seq: int, past: int, tokens: list[int], engine: int | None = None) -> int:
        """Submit and wait; returns the final job status (DriverError on infer/Wait failure)."""
        check(self.submit(slot, seq, past, tokens, engine), f"{slot.name}: infer(seq={seq})")
        rc, status = slot.wait()
        check(rc, f"{slot.name}: wait(seq={seq})")
        return status

    def set_latency(self, h2d_us: int = 0, prefill_per_token_us: int = 0, decode_us: int = 0, d2h_us: int = 0) -> bool:
        """Set the emulator's latency profile; False for a library without the control."""
        if self.emu is None:
            return False
        check(self.emu.set_latency(h2d_us, prefill_per_token_us, decode_us, d2h_us), "emu_set_latency")
        return True

    def counters(self) -> dict[str, int]:
        return self.emu.counters() if self.emu is not None else {}

    def seq_len(self, seq: int) -> int:
        rc, n = self.kv.seq_len(seq)
        check(rc, f"kv_seq_len({seq})")
        return n

    def probe(self, seq: int, at: int, ref_states: list[int], token: int = 4242) -> bool:
        """Does the device's KV state at position ``at`` equal ``ref_states[at]``? Runs one
        decode at past=at (a rewind) and compares its row with the oracle's."""
        if self._probe is None:
            self._probe = self.slot()
        slot = self._probe
        status = self.run(slot, seq, at, [token])
        if status != JobStatus.DONE:
            return False
        want = oracle.logits_bf16(oracle.mix(ref_states[at], token, at))
        return bool(np.array_equal(slot.last_row(), want))

    def close(self) -> int:
        return self.device.close()


def wait_final(slot: Slot, budget_s: float = 2.0) -> int:
    """Poll a job until it reaches a final status or budget_s passes; returns the status."""
    end = time.monotonic() + budget_s
    while True:
        rc, status = slot.wait(20_000)
        if rc != 13 or status in FINAL_STATUSES or time.monotonic() >= end:
            return status
