"""``calexec sim write-calbin`` and ``calexec sim bench``.

``write-calbin PATH [--tile-d0 N] [--seed S] [--hidden H]`` writes the default synthetic
calbin and prints its sha256; an old file at PATH is replaced only once the new one is whole.

``bench [--json] [--iters N] [--profile-iters N]`` measures on the bundled emulator:
* ``decode_job_us_*``: host-side cost of one zero-latency decode job, ``infer()`` + ``Wait()``
  (the device writes 151936 BF16 logits); CSR/position updates are outside the timed region;
* ``profile_error_pct``: with a 10 ms decode profile, (median job time - 10 ms) / 10 ms.
Prints one JSON object (``--json``) or a short table; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
import time
from collections.abc import Callable

import numpy as np

from calexec import cliargs
from calexec.contracts.files import write_whole
from calexec.drivers.calrt.runtime import JobStatus
from calexec.drivers.direct import DirectRunner, check
from calexec.drivers.synthetic import calbin as calbin_fmt

PROFILE_DECODE_US = 10_000


def _u64(text: str) -> int:
    """argparse type of ``--seed`` (the calbin stores it as a u64)."""
    value = cliargs.non_negative_int(text)
    if value >= 2**64:
        raise argparse.ArgumentTypeError(f"must be in 0..2**64-1, got {value}")
    return value


def _write_calbin(argv: list[str]) -> int:
    p = cliargs.parser("calexec sim write-calbin", "Write the default synthetic calbin to PATH "
                       "and print its sha256 (which names the model generation).")
    p.add_argument("path", type=cliargs.not_stdout, help="file to write")
    # (larger sizes write a calbin the emulator's loader refuses: every command then fails)
    p.add_argument("--tile-d0", type=cliargs.int_in(1, calbin_fmt.MAX_TILE_D0),
                   default=calbin_fmt.DEFAULT_TILE_D0,
                   help="logits tile D0 of the prefill models")
    p.add_argument("--seed", type=_u64, default=calbin_fmt.DEFAULT_SEED,
                   help="seed of the synthetic weights")
    p.add_argument("--hidden", type=cliargs.int_in(1, calbin_fmt.MAX_HIDDEN),
                   default=calbin_fmt.DEFAULT_HIDDEN,
                   help="hidden size")
    args = p.parse_args(argv)
    try:
        spec = calbin_fmt.default_spec(tile_d0=args.tile_d0, seed=args.seed, hidden=args.hidden)
    except ValueError as exc:
        raise cliargs.UserError(str(exc)) from None
    try:
        data = calbin_fmt.dumps(spec)
        write_whole(args.path, data)  # (a write cut short leaves the old calbin whole)
        sha = hashlib.sha256(data).hexdigest()
    except OSError as exc:
        raise cliargs.UserError(f"cannot write {args.path!r}: {exc.strerror or exc}") from None
    print(sha)
    return 0


def _decode_job_times(runner: DirectRunner, iters: int, seq: int,
                      tick: Callable[[int], None] | None = None) -> np.ndarray:
    """Per-job infer+Wait time in microseconds of iters consecutive decode jobs on seq;
    ``tick(done)`` after each job, outside the timed part."""
    name = calbin_fmt.DECODE
    s = runner.slot(name)
    dev, kv, model, inbuf, outbuf = runner.device, runner.kv, s.model, s.inbuf, s.outbuf
    # Seed the sequence with one token so every timed job is a plain next-position decode.
    check(runner.submit(name, seq, 0, tokens=[1]), "warmup infer")
    runner.finish(name)
    if not kv.apply(seq, iters + 1):
        raise RuntimeError(f"kv apply for {iters + 1} tokens refused")
    ids, pos = s.inputs["input_ids"], s.inputs["positions"]
    out = np.empty(iters, dtype=np.float64)
    clock = time.perf_counter_ns
    for i in range(iters):
        past = i + 1
        ids[0, 0] = 7
        pos[0, 0] = past
        inbuf.set_csr("cur_seq_len", 1)
        inbuf.set_csr("total_seq_len", past + 1)
        t0 = clock()
        rc = dev.infer(model, kv, seq, inbuf, outbuf)
        wrc = outbuf.wait(-1)
        out[i] = (clock() - t0) / 1e3
        check(rc, "infer")
        check(wrc, "wait")
        if tick is not None:
            tick(i + 1)
    rc, status = outbuf.get_status()
    if status != JobStatus.DONE:
        raise RuntimeError(f"decode job ended with status {status}")
    return out


def _bench(argv: list[str]) -> int:
    p = cliargs.parser("calexec sim bench", __doc__)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    # each run decodes one sequence: its tokens + the seed token fit the model's max_seq
    jobs = cliargs.int_in(1, calbin_fmt.MAX_SEQ - 1)
    p.add_argument("--iters", type=jobs, default=2000, help="zero-latency decode jobs")
    p.add_argument("--profile-iters", type=jobs, default=50, help="10 ms decode jobs")
    cliargs.add_device_args(p, manifest=False)
    args = p.parse_args(argv)
    cliargs.progress_s()  # (a bad $CALEXEC_PROGRESS_S refused before the run, not in it)
    device = cliargs.device_spec(args, synthetic="sim bench runs on the emulator")
    with tempfile.TemporaryDirectory(prefix="calexec-bench-") as tmp:
        path = device.calbin(tmp)
        rt = device.runtime()
        if not rt.has_emu:
            raise cliargs.UserError(f"{device.library!r} has no emulator controls (calrt_emu_*): "
                                    "sim bench measures the emulator")
        runner = DirectRunner(rt, path)
        print(f"sim bench: {args.iters} zero-latency decode jobs", file=sys.stderr)
        zero = _decode_job_times(runner, args.iters, seq=0, tick=cliargs.Ticker(
            "sim bench", "zero-latency decode jobs", args.iters))
        print(f"sim bench: {args.profile_iters} decode jobs at {PROFILE_DECODE_US} us", file=sys.stderr)
        check(runner.device.emu.set_latency(decode_us=PROFILE_DECODE_US), "set_latency")
        prof = _decode_job_times(runner, args.profile_iters, seq=1, tick=cliargs.Ticker(
            "sim bench", f"decode jobs at {PROFILE_DECODE_US} us", args.profile_iters))
        counters = runner.device.emu.counters()
        runner.close()
    med = float(np.median(prof))
    result = {
        "runtime": rt.version,
        "decode_job_iters": args.iters,
        "decode_job_us_p50": round(float(np.percentile(zero, 50)), 2),
        "decode_job_us_p99": round(float(np.percentile(zero, 99)), 2),
        "decode_job_us_mean": round(float(zero.mean()), 2),
        "profile_decode_us": PROFILE_DECODE_US,
        "profile_job_us_p50": round(med, 2),
        "profile_error_pct": round((med - PROFILE_DECODE_US) / PROFILE_DECODE_US * 100.0, 3),
        "dma_violations": counters["dma_input_violations"] + counters["dma_output_violations"],
    }
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k:<22} {v}")
    return 0


@cliargs.command_main
def main(argv: list[str]) -> int:
    if argv[:2] == ["sim", "write-calbin"]:
        return _write_calbin(argv[2:])
    if argv[:2] == ["sim", "bench"]:
        return _bench(argv[2:])
    print("usage: calexec sim {write-calbin PATH | bench [--json]}", file=sys.stderr)
    return 2
