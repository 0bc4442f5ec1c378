"""``calexec demo``: a few sequences prefilled and greedily decoded, interleaved, through the
``DeviceExecutor`` (the control core) on the bundled emulator, checked against the oracle.

Also home of ``DirectRunner``, the synchronous driver harness (no executor: submit, Wait,
read back) that ``calexec sim bench``, the overhead benchmark's baseline and the driver tests
share. The harness raises ``DriverError`` carrying the raw code instead of returning it, which
the executor's control path must never do.
"""

from __future__ import annotations

import hashlib
import sys
import tempfile
import time

import numpy as np

from calexec import cliargs
from calexec.drivers.synthetic import calbin as calbin_fmt
from calexec.drivers.synthetic import oracle
from calexec.drivers.calrt.runtime import CalRT, JobStatus


class DriverError(RuntimeError):
    """A CalRT call of the harness failed; ``code`` is the raw CalRT code."""

    def __init__(self, what: str, code: int) -> None:
        super().__init__(f"{what} failed with CalRT code {code}")
        self.code = code


def check(rc: int, what: str) -> None:
    if rc != 0:
        raise DriverError(what, rc)


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
    rc, device = rt.open_device(config)
    check(rc, f"device_open({config!r})")
    rc, calbin = device.load_calbin(calbin_path)
    check(rc, "calbin_load")
    check(device.configure(calbin), "configure")
    rc, kv = device.create_kv(calbin)
    check(rc, "kv_create")
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


def _argmax(row: np.ndarray) -> int:
    return int(np.argmax(oracle.bf16_to_f32(row)))


@cliargs.command_main
def main(argv: list[str]) -> int:
    from calexec.contracts.prepare import InferenceRequest
    from calexec.contracts.status import Status
    from calexec.contracts.types import TaskKind
    from calexec.machines.executor import DeviceExecutor, ExecutorConfig

    p = cliargs.parser("calexec demo", __doc__)
    p.add_argument("--seqs", type=cliargs.positive_int, default=3,
                   help="sequences prefilled, then decoded round-robin")
    p.add_argument("--tokens", type=cliargs.positive_int, default=5,
                   help="tokens to decode per sequence")
    p.add_argument("--prompt-len", type=cliargs.positive_int, default=17,
                   help="prompt tokens per sequence")
    p.add_argument("--decode-us", type=int, default=0,
                   help="emulated decode latency in microseconds (emulator device config)")
    cliargs.add_device_args(p)
    args = p.parse_args(argv[1:])
    if args.prompt_len + args.tokens > calbin_fmt.MAX_SEQ:
        raise cliargs.UserError(f"--prompt-len + --tokens = {args.prompt_len + args.tokens}: "
                                f"above the model's max_seq {calbin_fmt.MAX_SEQ}")
    spec = cliargs.device_spec(args)
    with tempfile.TemporaryDirectory(prefix="calexec-demo-") as tmp:
        path = spec.calbin(tmp)
        try:  # the oracle checks the tokens: only a synthetic calbin has one
            spec_of_calbin = calbin_fmt.read(path)
        except (OSError, ValueError) as exc:
            raise cliargs.UserError(f"--calbin={path!r}: the demo checks tokens against the "
                                    f"synthetic model's oracle and needs a synthetic calbin "
                                    f"(calexec sim write-calbin): {exc}") from None
        seed = spec_of_calbin.seed
        with open(path, "rb") as f:
            sha = hashlib.sha256(f.read()).hexdigest()
        config = ExecutorConfig(calbin_path=path, device_config=f"decode_us={args.decode_us}",
                                recovery=spec.recovery())
        ex = DeviceExecutor(spec.runtime(), spec.manifest(), config)
        status = ex.start()
        if not status.ok:
            raise cliargs.UserError(f"executor start failed: {status}", cliargs.EXIT_REFUSED)
        print(f"runtime {ex.runtime.version}, calbin sha256 {sha[:16]}..., generation "
              f"{ex.gen.id}, lifecycle {ex.state}, golden {list(ex.expected_golden(sha)[0])}")
        seqs = range(1, args.seqs + 1)
        refs = {seq: oracle.OracleSequence(seed) for seq in seqs}
        state: dict[int, dict] = {}

        def run(seq: int, kind: TaskKind, tokens: list[int], past: int):
            request = InferenceRequest(
                seq_id=seq, kind=kind, tokens=np.asarray(tokens, dtype=np.int32),
                positions=np.arange(past, past + len(tokens), dtype=np.int32), past_len=past,
                deadline=time.monotonic() + 30.0)
            return ex.enqueue(request).wait_until(request.deadline)

        ok = True
        for seq in seqs:  # prefill every sequence, then decode them round-robin
            prompt = [(seq * 7919 + i * 104729) % calbin_fmt.VOCAB for i in range(args.prompt_len)]
            result = run(seq, TaskKind.PREFILL_IDS, prompt, 0)
            if isinstance(result, Status):
                print(f"seq {seq}: prefill failed: {result}", file=sys.stderr)
                return 1
            refs[seq].run(prompt)
            ok &= result.argmax == refs[seq].next_token()
            state[seq] = {"prompt": len(prompt), "tokens": [result.argmax], "past": result.kv_len,
                          "ttft_ms": result.timings.total_ms(), "tpot_ms": []}
        for _ in range(args.tokens - 1):
            for seq in seqs:
                st = state[seq]
                result = run(seq, TaskKind.DECODE, [st["tokens"][-1]], st["past"])
                if isinstance(result, Status):
                    print(f"seq {seq}: decode failed: {result}", file=sys.stderr)
                    return 1
                refs[seq].run([st["tokens"][-1]])
                ok &= result.argmax == refs[seq].next_token()
                st["tokens"].append(result.argmax)
                st["past"] = result.kv_len
                st["tpot_ms"].append(result.timings.total_ms())
        for seq in seqs:
            st = state[seq]
            tpot = np.median(st["tpot_ms"]) if st["tpot_ms"] else float("nan")
            print(f"seq {seq}: prompt {st['prompt']} tokens, ttft {st['ttft_ms']:.2f} ms, "
                  f"tpot {tpot:.3f} ms, tokens {st['tokens']}")
        snapshot = ex.snapshot()
        counters = ex.device.emu.counters() if ex.device.emu else {}
        status = ex.shutdown()
    print(f"oracle match: {'yes' if ok else 'NO'}; executor: succeeded={snapshot['succeeded']} "
          f"failed={snapshot['failed']} slots={snapshot['slots']}; shutdown {status}, "
          f"lifecycle {ex.state}; device: {counters}")
    return 0 if ok and status.ok else 1

