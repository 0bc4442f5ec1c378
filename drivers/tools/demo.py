"""``calexec demo``: a few sequences prefilled and greedily decoded, interleaved, through the
``DeviceExecutor`` (the control core) on the bundled emulator, checked against the oracle.

The direct synchronous harness (no executor, used by the benchmarks, conform and the driver
tests) lives in ``drivers/direct.py``.
"""

from __future__ import annotations

import hashlib
import sys
import tempfile
import time
from typing import TYPE_CHECKING

import numpy as np

from calexec import cliargs
from calexec.drivers.synthetic import calbin as calbin_fmt
from calexec.drivers.synthetic import oracle

if TYPE_CHECKING:
    from calexec.machines.api import ExecutorSnapshot
    from calexec.machines.executor import DeviceExecutor


def _argmax(row: np.ndarray) -> int:
    return int(np.argmax(oracle.bf16_to_f32(row)))


#: how long the demo waits for the last job's buffer slot to come back before it reports
SETTLE_S = 5.0
#: a request's deadline beyond its emulated decode latency
REQUEST_SLACK_S = 30.0
#: from this decode latency on (a second per token) the demo says on stderr what it is doing
PROGRESS_FROM_US = 1_000_000


def _settled_snapshot(ex: DeviceExecutor) -> ExecutorSnapshot:
    """``ex.snapshot()`` once no buffer slot is Leased or InFlight (bounded by SETTLE_S): the
    completion thread gives a job's slot back just after resolving it, so a snapshot taken
    right after the last result could still count that slot in flight."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        snapshot = ex.snapshot()
        slots = snapshot["slots"] or {}
        if slots.get("Leased", 0) + slots.get("InFlight", 0) == 0 or time.monotonic() > deadline:
            return snapshot
        time.sleep(0.001)


@cliargs.command_main
def main(argv: list[str]) -> int:
    from calexec.contracts.prepare import InferenceRequest
    from calexec.contracts.status import Status
    from calexec.contracts.types import TaskKind
    from calexec.drivers.calrt.runtime import emulator_of
    from calexec.drivers.device_spec import with_emulated_latency
    from calexec.machines.executor import DeviceExecutor, ExecutorConfig

    p = cliargs.parser("calexec demo", __doc__)
    p.add_argument("--seqs", type=cliargs.positive_int, default=3,
                   help="sequences prefilled, then decoded round-robin")
    p.add_argument("--tokens", type=cliargs.positive_int, default=5,
                   help="tokens to decode per sequence")
    p.add_argument("--prompt-len", type=cliargs.positive_int, default=17,
                   help="prompt tokens per sequence")
    p.add_argument("--decode-us", type=cliargs.latency_us, default=0,
                   help="emulated decode latency in microseconds (emulator device config); "
                        "the warm-up's and each request's deadline grow by it, and from "
                        f"{PROGRESS_FROM_US} (a second per token) each step is said on stderr")
    cliargs.add_device_args(p)
    args = p.parse_args(argv[1:])
    cliargs.progress_s()  # (a bad $CALEXEC_PROGRESS_S refused before the run, not in it)
    if args.prompt_len + args.tokens > calbin_fmt.MAX_SEQ:
        raise cliargs.UserError(f"--prompt-len + --tokens = {args.prompt_len + args.tokens}: "
                                f"above the model's max_seq {calbin_fmt.MAX_SEQ}")
    spec = cliargs.device_spec(
        args, synthetic="the demo checks tokens against the synthetic model's oracle")
    cliargs.check_calbin(spec)
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
        # (the warm-up's and the execution deadlines grow by the decode latency)
        config = with_emulated_latency(
            ExecutorConfig(calbin_path=path, device_config=f"decode_us={args.decode_us}",
                           recovery=spec.recovery()))
        slow = args.decode_us >= PROGRESS_FROM_US
        runtime = spec.runtime()
        ex = DeviceExecutor(runtime, spec.manifest(), config)
        if slow:
            cliargs.say("calexec demo", f"warm-up: a prefill and {config.golden_decode_steps} "
                                        f"decode steps of {args.decode_us / 1e6:g} s each")
        try:
            status = ex.start()
            if not status.ok:
                raise cliargs.UserError(f"executor start failed: {status}", cliargs.EXIT_REFUSED)
            max_seqs = getattr(ex.kv, "max_seqs", None)  # known once started
            if max_seqs is not None and args.seqs >= max_seqs:  # ids 1..seqs
                ex.shutdown()
                raise cliargs.UserError(f"--seqs={args.seqs}: the device's KvManager takes sequence "
                                        f"ids 0..{max_seqs - 1} (max_seqs={max_seqs}; 0 is the "
                                        f"warm-up's), so at most {max_seqs - 1}")
            golden = ex.life.expected_golden(sha)[0]
            print(f"runtime {runtime.version}, calbin sha256 {sha[:16]}..., generation "
                  f"{None if ex.gen is None else ex.gen.id}, lifecycle {ex.state}, golden "
                  f"{None if golden is None else list(golden)}")
            seqs = range(1, args.seqs + 1)
            refs = {seq: oracle.OracleSequence(seed) for seq in seqs}
            state: dict[int, dict] = {}

            def run(seq: int, kind: TaskKind, tokens: list[int], past: int):
                request = InferenceRequest(
                    seq_id=seq, kind=kind, tokens=np.asarray(tokens, dtype=np.int32),
                    positions=np.arange(past, past + len(tokens), dtype=np.int32), past_len=past,
                    deadline=time.monotonic() + REQUEST_SLACK_S + args.decode_us / 1e6)
                if slow:
                    cliargs.say("calexec demo", f"seq {seq}: {kind.name.lower()} at position {past}")
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
            # (quick runs stay as quiet as they were; a slow decode says every job already)
            tick = cliargs.Ticker("calexec demo", "decode rounds", args.tokens - 1, last=False)
            for done in range(args.tokens - 1):
                if not slow:
                    tick(done)
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
                tpot = (f"{np.median(st['tpot_ms']):.3f} ms" if st["tpot_ms"]
                        else "- (one token: no decode step)")  # (not "nan ms")
                print(f"seq {seq}: prompt {st['prompt']} tokens, ttft {st['ttft_ms']:.2f} ms, "
                      f"tpot {tpot}, tokens {st['tokens']}")
            snapshot = _settled_snapshot(ex)
            emu = emulator_of(ex.device)
            counters = emu.counters() if emu else {}
            status = ex.shutdown()
        finally:  # (an interrupt, a job that failed: the executor ran on, its device never
            if not ex.lifecycle.final:  # shut down, its threads left to the exit)
                ex.shutdown()
    print(f"oracle match: {'yes' if ok else 'NO'}; executor: succeeded={snapshot['succeeded']} "
          f"failed={snapshot['failed']} slots={snapshot['slots']}; shutdown {status}, "
          f"lifecycle {ex.state}; device: {counters}")
    return 0 if ok and status.ok else 1

