"""The direct synchronous path: the driver harness with no executor (submit, Wait, read back on
the calling thread), what llama-calrt did before calexec. ``calexec sim bench``, the overhead
benchmark's baseline, the acceptance rig, ``calexec conform`` and the driver tests share it.

It raises ``DriverError`` carrying the raw CalRT code instead of returning it, which the
executor's control path (machines/) must never do: this is a measuring and testing harness.
"""

from __future__ import annotations

from typing import TypeVar

import numpy as np

from calexec.drivers.calrt.runtime import CalRT, JobStatus
from calexec.drivers.synthetic import calbin as calbin_fmt

T = TypeVar("T")


class DriverError(RuntimeError):
    """A CalRT call of the harness failed; ``code`` is the raw CalRT code."""

    def __init__(self, what: str, code: int) -> None:
        super().__init__(f"{what} failed with CalRT code {code}")
        self.code = code


def check(rc: int, what: str) -> None:
    if rc != 0:
        raise DriverError(what, rc)


def made(rc: int, obj: T | None, what: str) -> T:
    """The object a call that answered ``rc`` made: DriverError unless ``rc`` is 0 (the
    driver returns an object exactly then; one missing is reported as code -1)."""
    check(rc, what)
    if obj is None:
        raise DriverError(f"{what} (no object)", -1)
    return obj


class _Slot:
    """Buffers and host arrays of one model (host arrays never move: they are mapped)."""

    def __init__(self, model) -> None:
        self.model = model
        info = model.info
        self.inputs: dict[str, np.ndarray] = {}
        rc, self.inbuf = model.create_input_buf()
        check(rc, f"{info.name}: create_input_buf")
        rc, self.outbuf = model.create_output_buf()
        check(rc, f"{info.name}: create_output_buf")
        dt = {"S32": np.int32, "BF16": np.uint16}
        for t in info.inputs:
            arr = np.zeros(t.shape, dtype=dt[t.dtype])
            check(self.inbuf.map(t.name, arr), f"{info.name}: map {t.name}")
            self.inputs[t.name] = arr
        out = info.outputs[0]
        self.logits = np.zeros(out.shape, dtype=np.uint16)
        check(self.outbuf.map(out.name, self.logits), f"{info.name}: map {out.name}")
        self.sliceable = {t.name: t.sliceable for t in info.inputs}
        self.row_elems = {t.name: int(np.prod(t.shape[2:], dtype=np.int64)) for t in info.inputs}


def open_configured(rt: CalRT, calbin_path: str, config: str = ""):
    """Device opened, calbin loaded and configured, KV manager created, models by exact name
    (the harness setup shared by DirectRunner and the conformance rig; raises DriverError)."""
    device = made(*rt.open_device(config), f"device_open({config!r})")
    calbin = made(*device.load_calbin(calbin_path), "calbin_load")
    check(device.configure(calbin), "configure")
    kv = made(*device.create_kv(calbin), "kv_create")
    rc, models = calbin.models()
    check(rc, "get_all_models")
    return device, calbin, kv, {m.info.name: m for m in models}  # exact names only


class DirectRunner:
    """One device, one calbin (configured), one KV manager and one buffer slot per model.

    ``submit`` fills the slot's host arrays, slices, sets CSRs, Applies KV and calls infer;
    ``finish`` Waits and returns the job status; the slot's ``logits`` array holds the output.
    """

    def __init__(self, rt: CalRT, calbin_path: str, config: str = "") -> None:
        self.device, self.calbin, self.kv, self.models = open_configured(rt, calbin_path, config)
        self.spec = calbin_fmt.read(calbin_path)
        self._slots: dict[str, _Slot] = {}

    def slot(self, name: str) -> _Slot:
        if name not in self._slots:
            if name not in self.models:
                raise KeyError(f"calbin has no model named {name!r}")
            self._slots[name] = _Slot(self.models[name])
        return self._slots[name]

    def submit(self, name: str, seq: int, past: int, tokens=None, embeds=None, task: int | None = None) -> int:
        """Prepare and submit one job; returns infer()'s code (KV Apply failure -> DriverError)."""
        s = self.slot(name)
        if embeds is not None:
            n = int(embeds.shape[0])
            s.inputs["inputs_embeds"][0, :n] = embeds
            data_name = "inputs_embeds"
        else:
            n = len(tokens)
            s.inputs["input_ids"][0, :n] = tokens
            data_name = "input_ids"
        s.inputs["positions"][0, :n] = np.arange(past, past + n, dtype=np.int32)
        for t in (data_name, "positions"):
            if s.sliceable[t]:
                check(s.inbuf.slice(t, 0, n * s.row_elems[t]), f"{name}: slice {t}")
        check(s.inbuf.set_csr("cur_seq_len", n), f"{name}: set_csr cur_seq_len")
        check(s.inbuf.set_csr("total_seq_len", past + n), f"{name}: set_csr total_seq_len")
        if not self.kv.apply(seq, past + n):
            raise DriverError(f"{name}: kv apply(seq={seq}, target={past + n})", 0)
        if task is None:
            return self.device.infer(s.model, self.kv, seq, s.inbuf, s.outbuf)
        return self.device.infer_with_fixed_task_type(s.model, self.kv, seq, s.inbuf, s.outbuf, task)

    def finish(self, name: str, timeout_us: int = -1) -> int:
        """Wait for the slot's job; returns its JobStatus (DriverError on a Wait failure)."""
        s = self.slot(name)
        check(s.outbuf.wait(timeout_us), f"{name}: wait")
        rc, status = s.outbuf.get_status()
        check(rc, f"{name}: get_status")
        return status

    def run(self, name: str, seq: int, past: int, tokens=None, embeds=None) -> np.ndarray:
        """Submit + finish; returns the logits row of the last token (BF16 bits)."""
        check(self.submit(name, seq, past, tokens, embeds), f"{name}: infer")
        status = self.finish(name)
        if status != JobStatus.DONE:
            raise DriverError(f"{name}: job ended {JobStatus(status).name}", 0)
        s = self.slot(name)
        n = len(tokens) if tokens is not None else int(embeds.shape[0])
        return s.logits[0, (n - 1) % s.logits.shape[1]]

    def close(self) -> int:
        return self.device.close()
