"""``calexec accept``: the spec's §13 acceptance gates on the bundled emulator.

``calexec accept [--quick | --full] [--phase a|b|both] [--report DIR] [--json]
[--soak-seconds S] [--chaos-seconds S] [--gates NAME,...]``

Gates (``drivers/tools/accept/gates.py`` says what each proves): correctness, lengths, crosstalk,
injections, soak, chaos; each runs once per selected phase (``a``: in-flight capacity 1; ``b``:
capacity 2 with PING/PONG slots) and is reported as ``<gate>_<phase>`` with ``passed``, its
measured ``value`` (named by ``metric``) and details. ``--quick`` (the default, what CI runs)
uses reduced sizes and a 20 s soak; ``--full`` the spec's sizes and a 24 h soak unless
``--soak-seconds`` says otherwise. With ``--report DIR``: report.md, report.json (the same
content) and PNG plots (per-job latency distribution, RSS over the soak). ``--json`` prints the
report object. Progress goes to stderr: a bar on a terminal, plain lines (at most one per 10 s,
one per gate) in a log. ``--runtime-lib`` / ``--manifest`` / ``--calbin`` replace the bundled
emulator, its manifest and the synthetic calbin (the gates need the emulator controls and a
synthetic calbin, with a pinned golden: they inject faults and check every token against the
oracle). Exit status:
0 all gates passed, 1 a gate failed, 2 usage or configuration error.

Python API: ``run_accept(sizes, phases, gates, progress)`` -> report dict; ``QUICK`` / ``FULL``
and ``attrs.evolve`` for a test-size override.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

from calexec import cliargs
from calexec.drivers.device_spec import DeviceSpec
from calexec.drivers.memory import pin_mmap_threshold
from calexec.drivers.synthetic import calbin as calbin_fmt
from calexec.drivers.tools.accept.gate_rig import Progress, Silent, unpinned_golden
from calexec.drivers.tools.accept.gates import GATES, AcceptContext
from calexec.drivers.tools.accept.report import REPORT_FILES, write_report

SPEC_LENGTHS = (1, 2, 15, 16, 17, 127, 128, 1024, 4095, 4096, 40959)


def _positive(instance: Any, attribute: Any, value: Any) -> None:
    if value <= 0:
        raise ValueError(f"Sizes.{attribute.name} must be > 0, got {value!r}")


@attrs.frozen
class Sizes:
    """Gate sizes. ``QUICK`` is bounded for CI on a 2-core machine; ``FULL`` is §13's."""

    mode: str
    prompts: int = attrs.field(validator=_positive)
    max_prompt_len: int = attrs.field(validator=_positive)
    decode_steps: int = attrs.field(validator=_positive)
    lengths: tuple[int, ...] = attrs.field(converter=tuple[int, ...])
    crosstalk_tokens: int = attrs.field(validator=_positive)
    injections: int = attrs.field(validator=_positive)
    soak_seconds: float = attrs.field(validator=_positive)
    soak_sample_s: float = attrs.field(default=0.25, validator=_positive)
    soak_fault_every_s: float = attrs.field(default=2.0, validator=_positive)
    soak_warmup_fraction: float = 0.3
    #: the threaded fault soak of the reference server (issue 13), per phase
    chaos_seconds: float = attrs.field(default=6.0, validator=_positive)
    seed: int = 0

    @lengths.validator
    def _lengths(self, attribute: Any, value: tuple[int, ...]) -> None:
        bad = [n for n in value if not 1 <= n < calbin_fmt.MAX_SEQ]
        if bad:
            raise ValueError(f"Sizes.lengths must be in [1, {calbin_fmt.MAX_SEQ}), got {bad}")


# 40959 stays in quick mode: a 40959-token prefill takes ~10 ms on the emulator and ~30 ms in
# the oracle (measured), so nothing is skipped.
QUICK = Sizes(mode="quick", prompts=20, max_prompt_len=64, decode_steps=8, lengths=SPEC_LENGTHS,
              crosstalk_tokens=200, injections=100, soak_seconds=20.0)
FULL = Sizes(mode="full", prompts=100, max_prompt_len=256, decode_steps=32,
             lengths=SPEC_LENGTHS, crosstalk_tokens=1000, injections=1000,
             soak_seconds=24 * 3600.0, soak_sample_s=5.0, soak_fault_every_s=600.0,
             soak_warmup_fraction=0.1, chaos_seconds=1800.0)
PHASES = {"a": ("a",), "b": ("b",), "both": ("a", "b")}
#: the fewest RSS / slot / queue samples the soak gate judges growth on: its check compares
#: thirds of the samples after the warm-up, so a shorter soak (a 1 s quick one: 3 samples
#: left, one per third) read one sample's noise as RSS growth and failed the gate
MIN_SOAK_SAMPLES = 12


def soak_refusal(sizes: Sizes) -> str | None:
    """Why the soak gate cannot judge a soak of ``sizes`` (None: it can): shorter than
    :data:`MIN_SOAK_SAMPLES` samples."""
    least = MIN_SOAK_SAMPLES * sizes.soak_sample_s
    if sizes.soak_seconds >= least:
        return None
    return (f"--soak-seconds={sizes.soak_seconds:g}: the soak gate needs at least {least:g} s "
            f"in {sizes.mode} mode ({MIN_SOAK_SAMPLES} samples, one every "
            f"{sizes.soak_sample_s:g} s: it compares thirds of those after its warm-up)")


#: the shortest chaos gate (``--chaos-seconds``) that judges anything: each step of its schedule
#: arms one fault and lets the 16 clients meet it for 0.2-0.5 s before waiting for ``/ready``
#: (about 0.45 s a step here, 6 s: 14 faults, ~110 requests). A shorter one (0.01 s) ran one
#: fault and ~16 requests and PASSED, a verdict on nearly nothing; 3 s is ~6 faults of the 16
#: kinds and ~50 requests, the least the rules (wrong tokens, ids conserved, /ready after each
#: fault) are worth checking on
MIN_CHAOS_SECONDS = 3.0


def chaos_refusal(sizes: Sizes) -> str | None:
    """Why the chaos gate cannot judge a fault soak of ``sizes`` (None: it can): shorter than
    :data:`MIN_CHAOS_SECONDS`."""
    if sizes.chaos_seconds >= MIN_CHAOS_SECONDS:
        return None
    return (f"--chaos-seconds={sizes.chaos_seconds:g}: the chaos gate needs at least "
            f"{MIN_CHAOS_SECONDS:g} s (its schedule arms one fault every 0.2-0.5 s of traffic; "
            "a shorter soak injects one or two faults into a few requests, too small a sample "
            "to pass or fail on)")


def run_accept(sizes: Sizes = QUICK, phases: Sequence[str] = ("a", "b"),
               gates: Sequence[str] | None = None, progress: Progress | None = None,
               device: DeviceSpec = DeviceSpec()) -> dict[str, Any]:
    """Run ``gates`` (default all, in ``GATES`` order) for each phase; return the report
    object: ``passed`` (every gate passed), ``gates`` (name -> ``Gate.to_dict()``), the sizes,
    environment, and the per-job latency / RSS series the plots are drawn from. ``device``:
    the runtime library (it needs the emulator controls: the gates inject faults), manifest
    and synthetic calbin (the oracle checks every token); default the bundled emulator's."""
    names = list(GATES) if gates is None else list(dict.fromkeys(gates))  # a repeat runs once
    unknown = [g for g in names if g not in GATES]
    if unknown:
        raise ValueError(f"unknown gate(s) {unknown}; known: {list(GATES)}")
    if not device.runtime().has_emu:
        raise ValueError(f"runtime library {device.library!r} has no emulator controls "
                         "(calrt_emu_*): the gates inject faults and set latencies through them")
    if "soak" in names:
        refusal = soak_refusal(sizes)
        if refusal is not None:
            raise ValueError(refusal)
        pin_mmap_threshold()  # RSS must reflect live memory (drivers/memory.py)
    if "chaos" in names:
        refusal = chaos_refusal(sizes)
        if refusal is not None:
            raise ValueError(refusal)
    progress = progress or Silent(0)
    progress.total = max(1, len(names) * len(phases))
    started = time.time()
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="calexec-accept-") as tmp:
        path = device.calbin(tmp)
        unpinned = unpinned_golden(path, device)
        if unpinned is not None:
            raise ValueError(unpinned)
        ctx = AcceptContext(calbin_path=path, seed=calbin_fmt.read(path).seed, sizes=sizes,
                            device=device)
        for phase in phases:
            for name in names:
                t0 = time.monotonic()
                gate = GATES[name](ctx, phase, progress)
                progress.gate_done()
                results[gate.name] = {**gate.to_dict(),
                                      "seconds": round(time.monotonic() - t0, 3)}
    progress.close()
    return {
        "passed": all(g["passed"] for g in results.values()),
        "mode": sizes.mode, "phases": list(phases), "sizes": attrs.asdict(sizes),
        "gates": results,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "seconds": round(time.time() - started, 3),
        "series": {"latency_ms": {k: [round(v, 4) for v in r.values]
                                  for k, r in ctx.latencies_ms.items()},
                   "latency_jobs": {k: r.seen for k, r in ctx.latencies_ms.items()},
                   "rss_mib": {k: [[round(t, 3), round(v, 3)] for t, v in vals]
                               for k, vals in ctx.rss_series.items()}},
        "environment": {"cpus": os.cpu_count(), "python": platform.python_version(),
                        "numpy": np.__version__, "platform": platform.platform()},
    }


def gate_list(text: str) -> list[str]:
    """``--gates``' value: comma-separated names of ``GATES``, each once (a repeat is
    dropped); an empty item (``correctness,,``) or an unknown name is refused naming the
    flag (exit 2), never taken for "every gate"."""
    names = [g.strip() for g in text.split(",")]
    bad = [g for g in names if g not in GATES]
    if bad:
        raise argparse.ArgumentTypeError(
            f"{text!r}: {', '.join(repr(g) for g in bad)} is not a gate; "
            f"give a comma-separated subset of {','.join(GATES)}")
    return list(dict.fromkeys(names))


def _runs_gate(gate: str, args: argparse.Namespace) -> bool:
    """Whether the command line ``args`` runs ``gate`` (``--gates`` absent: every gate)."""
    return args.gates is None or gate in args.gates


def _parser() -> argparse.ArgumentParser:
    p = cliargs.parser("calexec accept", __doc__)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="reduced sizes, 20 s soak (default)")
    mode.add_argument("--full", action="store_true", help="the spec's sizes, 24 h soak")
    p.add_argument("--phase", choices=sorted(PHASES), default="both",
                   help="a: in-flight 1; b: in-flight 2 (PING/PONG); both (default)")
    p.add_argument("--report", metavar="DIR", type=cliargs.output_file, help="write report.md, report.json and plots")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.add_argument("--soak-seconds", type=cliargs.seconds,
                   help="soak duration (quick 20, full 86400)")
    p.add_argument("--chaos-seconds", type=cliargs.seconds,
                   help="length of the chaos gate's fault soak of the server per phase "
                        f"(quick 6, full 1800; at least {MIN_CHAOS_SECONDS:g})")
    p.add_argument("--gates", type=gate_list, help=f"comma-separated subset of {','.join(GATES)}")
    # (a length for a gate --gates leaves out was taken and ignored: `--gates correctness
    # --soak-seconds 600` ran no soak, and said nothing)
    for flag, gate in (("--soak-seconds", "soak"), ("--chaos-seconds", "chaos")):
        p.only_with(flag, functools.partial(_runs_gate, gate),
                    f"sets the {gate} gate's length, and --gates leaves that gate out (add "
                    f"{gate} to --gates, or leave {flag} out)")
    cliargs.add_device_args(p)
    return p


@cliargs.command_main
def main(argv: list[str]) -> int:
    """Entry point; ``argv`` starts with the command word (``accept``)."""
    parser = _parser()
    args = parser.parse_args(argv[1:])
    sizes = FULL if args.full else QUICK
    if args.report:  # before the run: a missing extra or directory must not cost the run
        cliargs.require_extra("plots", "--report (PNG plots)")
        cliargs.output_dir("--report", args.report, REPORT_FILES)
    if "chaos" in (args.gates or GATES):
        # the chaos gate soaks the reference server with loopback clients: without the
        # [server] extra it ran the other gates for minutes, then printed "FAIL chaos_a
        # problems = 0", exit 1, the reason only in report.json
        install = cliargs.missing_extra("server")
        others = ",".join(g for g in (args.gates or GATES) if g != "chaos")
        if install is not None:
            raise cliargs.UserError(
                "the chaos gate (a fault soak of the reference server) needs the optional "
                f"[server] extra: {install}"
                + (f"; or leave the gate out: --gates {others}" if others else ""))
    device = cliargs.device_spec(
        args, synthetic="the gates check every token against the synthetic model's oracle")
    cliargs.check_calbin(device)
    try:
        if args.soak_seconds is not None:
            sizes = attrs.evolve(sizes, soak_seconds=args.soak_seconds)
        if args.chaos_seconds is not None:
            sizes = attrs.evolve(sizes, chaos_seconds=args.chaos_seconds)
        report = run_accept(sizes, PHASES[args.phase], args.gates, Progress(0), device)
    except ValueError as exc:
        print(f"calexec accept: {exc}", file=sys.stderr)
        return 2
    if args.report:  # (all the files or none: a Ctrl-C while they are written leaves none)
        try:
            with cliargs.staged_report("--report", args.report, REPORT_FILES) as scratch:
                write_report(report, scratch)
        except OSError as exc:
            raise cliargs.cannot_write(args.report, exc, "--report") from None
    if args.json:
        print(json.dumps({k: v for k, v in report.items() if k != "series"}))
    else:
        for name, gate in report["gates"].items():
            print(f"{'PASS' if gate['passed'] else 'FAIL'}  {name:<16} {gate['metric']} = "
                  f"{gate['value']}  ({gate['seconds']} s)")
        print(f"accept {report['mode']}: {'PASSED' if report['passed'] else 'FAILED'} in "
              f"{report['seconds']} s" + (f"; report in {args.report}" if args.report else ""))
    return 0 if report["passed"] else 1

