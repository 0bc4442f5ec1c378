"""``calexec conform``: answer the spec's §14 questions for any library implementing calrt.h.

Each experiment runs in its own child process with a timeout (``isolate.py``); a child that
crashes or hangs makes its questions ``inconclusive`` with the reason, and the run goes on.
Exit 0 when the run completed (whatever the verdicts), 1 when the runner itself failed
(e.g. the emulator library could not be built, or the report could not be written), 2 for a
bad flag (``--lib`` that is no file, or that Python cannot load as a calrt.h library; a
``--config`` whose key or value the library's ``calrt_device_open`` refuses).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from calexec import cliargs
from calexec.drivers.calrt import conformance as report
from calexec.drivers.calrt.runtime import ENV_LIB
from calexec.drivers.calrt.verdict import inconclusive
from calexec.drivers.synthetic import calbin as calbin_fmt
from calexec.drivers.tools.conform import overlap_trace
from calexec.drivers.tools.conform.experiment_rig import build_emulator_lib
from calexec.drivers.tools.conform.experiments import EXPERIMENTS, QUESTIONS
from calexec.drivers.tools.conform.isolate import ERROR, OK, run_isolated

MODULE = "calexec.drivers.tools.conform.experiments"


def _progress(msg: str) -> None:
    print(f"[conform] {msg}", file=sys.stderr, flush=True)


def _runtime_info(lib: str) -> tuple[str, bool]:
    """(version, has emulator controls), read in a child so a broken library cannot hurt us."""
    out = run_isolated("calexec.drivers.tools.conform.runner:probe_library", {"lib": lib}, 30.0)
    return tuple(out.result) if out.status == OK else (f"unknown ({out.reason})", False)


def probe_library(lib: str) -> tuple[str, bool]:
    from calexec.drivers.calrt.runtime import CalRT

    rt = CalRT.load(lib)
    return rt.version, rt.has_emu


class ConfigRefused(ValueError):
    """``--config`` names a key or value the library's ``calrt_device_open`` refuses (the
    message names it): every experiment would fail to open its device."""


def probe_config(lib: str, config: str) -> str | None:
    """Run in a child: why ``lib`` refuses the device config ``config`` (None: it opens)."""
    from calexec.drivers.calrt.runtime import CalRT
    from calexec.drivers.device_spec import DeviceSpec, DeviceSpecError

    try:
        DeviceSpec().check_device_config(CalRT.load(lib), config, flag="--config")
    except DeviceSpecError as exc:
        return str(exc)
    return None


def run(lib: str | None, config: str = "", quick: bool = False, only: tuple[str, ...] = (),
        timeout_s: float | None = None, work_dir: str | None = None,
        experiment_kwargs: dict[str, dict] | None = None,
        on_child: Callable[[str, int], None] | None = None,
        calbin_path: str | None = None) -> dict[str, Any]:
    """Run the experiments (all, or ``only``) and return the run dict the report renders.

    lib None builds the bundled emulator as ``libcalrt_emu.so`` into work_dir (a temp dir
    by default) and dlopens it. ``calbin_path``: a synthetic calbin to use (the experiments
    check outputs against its oracle); None writes the default one. ``experiment_kwargs`` passes
    extra keyword arguments to one experiment (tests); ``on_child(name, pid)`` is called when its child starts."""
    only = tuple(dict.fromkeys(only))  # a repeated --only runs once
    unknown = [name for name in only if name not in EXPERIMENTS]
    if unknown:
        raise ValueError(f"unknown experiment(s) {unknown}; known: {list(EXPERIMENTS)}")
    timeout_s = timeout_s or (30.0 if quick else 120.0)
    with tempfile.TemporaryDirectory(prefix="calexec-conform-") as tmp:
        work = work_dir or tmp
        bundled = lib is None
        if lib is None:  # (bundled)
            _progress("building libcalrt_emu.so (bundled emulator, dlopen path)")
            lib = build_emulator_lib(work)
        calbin = calbin_path or os.path.join(work, "conform.calbin")
        if calbin_path is None:
            calbin_fmt.write(calbin)
        version, has_emu = _runtime_info(lib)
        if config:  # a refused config would make every question inconclusive: say so first
            probe = run_isolated(f"{__name__}:probe_config", {"lib": lib, "config": config},
                                 30.0)
            if probe.status == OK and probe.result is not None:
                raise ConfigRefused(probe.result)
        questions, timeline, experiments = [], [], {}
        for name in only or tuple(EXPERIMENTS):
            _progress(f"experiment {name} ...")
            kwargs = {"lib": lib, "calbin": calbin, "config": config, "quick": quick,
                      **(experiment_kwargs or {}).get(name, {})}
            hook = (lambda pid, n=name: on_child(n, pid)) if on_child else None
            out = run_isolated(f"{MODULE}:exp_{name}", kwargs, timeout_s, on_start=hook)
            experiments[name] = {"status": out.status, "seconds": round(out.seconds, 3), "reason": out.reason}
            if out.status == OK:
                questions += out.result["answers"]
                timeline += out.result["timeline"]
            else:
                questions += [inconclusive(qid, claim, out.reason, experiment=name, outcome=out.status).to_dict()
                              for qid, claim in QUESTIONS[name].items()]
            _progress(f"experiment {name}: {out.status} in {out.seconds:.2f} s")
    return {"runtime": version, "library": lib, "bundled": bundled, "emulator_controls": has_emu,
            "config": config, "quick": quick, "questions": questions, "settings": report.safe_settings(questions),
            "experiments": experiments, "timeline": timeline}


#: the files ``write_report`` may write (trace.json and timing.png when there is a timeline)
REPORT_FILES = ("conformance.md", "conformance.json", "trace.json", "timing.png")


def write_report(run_dict: dict[str, Any], out_dir: str) -> list[str]:
    """Write conformance.md/.json, trace.json and timing.png (when there is a timeline)."""
    os.makedirs(out_dir, exist_ok=True)
    written = []
    if run_dict["timeline"]:
        overlap_trace.write_trace(os.path.join(out_dir, "trace.json"), run_dict["timeline"])
        overlap = next((q for q in run_dict["questions"] if q["id"] == "overlap.ping_pong"), None)
        title = f"{run_dict['runtime']}: overlap {overlap['finding']} ({overlap['verdict']})" if overlap else ""
        overlap_trace.write_png(os.path.join(out_dir, "timing.png"), run_dict["timeline"], title)
        written += ["trace.json", "timing.png"]
    run_dict["artifacts"] = written
    with open(os.path.join(out_dir, "conformance.json"), "w", encoding="utf-8") as f:
        f.write(report.to_json(run_dict))
    with open(os.path.join(out_dir, "conformance.md"), "w", encoding="utf-8") as f:
        f.write(report.to_markdown(run_dict))
    return ["conformance.md", "conformance.json", *written]


class _SpelledAs(argparse.Action):
    """Store the value, and in ``lib_flag`` the spelling the flag was given as (``--lib`` or
    ``--runtime-lib``, the name every other command has), so a refusal names what was typed."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)
        namespace.lib_flag = option_string or self.option_strings[0]


@cliargs.command_main
def main(argv: list[str]) -> int:
    p = cliargs.parser("calexec conform", __doc__)
    p.add_argument("--lib", "--runtime-lib", dest="lib", metavar="PATH", action=_SpelledAs,
                   help=f"shared library implementing calrt.h (default: ${ENV_LIB}, else build "
                        "the bundled emulator)")
    p.add_argument("--calbin", metavar="PATH", help="synthetic calbin the experiments load and check "
                   "against its oracle (default: the default synthetic calbin)")
    p.add_argument("--report", metavar="DIR", type=cliargs.output_file,
                   help="write conformance.md/.json, trace.json, timing.png here")
    p.add_argument("--json", action="store_true", help="print the run as one JSON object on stdout")
    p.add_argument("--quick", action="store_true", help="small sizes (seconds, for CI)")
    p.add_argument("--config", default="", help="device config string passed to calrt_device_open")
    p.add_argument("--only", action="append", choices=list(EXPERIMENTS), help="run only this experiment (repeat)")
    p.add_argument("--timeout", type=cliargs.seconds,
                   help="seconds per experiment, from its child's start of it "
                        "(default 30 quick / 120)")
    p.set_defaults(lib_flag="--lib")
    args = p.parse_args(argv[1:])
    flag = args.lib_flag  # (as typed: `--runtime-lib X`, as every other command, was `--lib=X`)
    if args.lib == "":  # (not the default: an unset variable in a script)
        raise cliargs.UserError(f"{flag}='': empty (omit the flag to build the bundled emulator)")
    if args.lib is None and os.environ.get(ENV_LIB):  # as every command that opens a device
        # (conform built and measured the bundled emulator whatever the variable named)
        args.lib, flag = os.environ[ENV_LIB], f"${ENV_LIB}"
    if args.lib and not os.path.exists(args.lib):
        print(f"calexec conform: {flag}={args.lib!r}: does not exist", file=sys.stderr)
        return 2
    if args.lib:  # a library Python cannot even load is a typo, not a run of inconclusives
        if not os.path.isfile(args.lib):
            raise cliargs.UserError(f"{flag}={args.lib!r}: not a regular file")
        probe = run_isolated("calexec.drivers.tools.conform.runner:probe_library",
                             {"lib": args.lib}, 30.0)
        if probe.status == ERROR:  # (a crash or a hang in it is reported by the run)
            reason = probe.reason.removeprefix("experiment failed: ").split("  Additionally")[0]
            raise cliargs.UserError(f"{flag}={args.lib!r}: cannot load it: {reason}")
    if args.calbin is not None:
        if os.path.exists(args.calbin) and not os.path.isfile(args.calbin):
            # (a FIFO's read waited for a writer without end, /dev/zero's filled the memory)
            raise cliargs.UserError(f"--calbin={args.calbin!r}: not a regular file")
        try:
            calbin_fmt.read(args.calbin)
        except (OSError, ValueError) as exc:
            raise cliargs.UserError(f"--calbin={args.calbin!r}: not a readable synthetic calbin: {exc}") from None
        args.calbin = os.path.abspath(args.calbin)
    if args.report:  # before the run: timing.png needs matplotlib, the files a directory
        cliargs.require_extra("plots", "--report (timing.png)")
        cliargs.output_dir("--report", args.report, REPORT_FILES)
    t0 = time.monotonic()
    try:
        with cliargs.sigterm_interrupts():  # (a SIGTERM ends the experiment's child too)
            result = run(args.lib, args.config, args.quick, tuple(args.only or ()),
                         args.timeout, calbin_path=args.calbin)
    except ConfigRefused as exc:
        raise cliargs.UserError(str(exc)) from None
    except (RuntimeError, OSError, ValueError) as exc:
        print(f"calexec conform: {exc}", file=sys.stderr)
        return 1
    if args.report:  # (checked before the run; what changed since is one line, exit 2)
        try:  # (all the files or none: a Ctrl-C while they are written leaves none)
            with cliargs.staged_report("--report", args.report, REPORT_FILES) as scratch:
                files = write_report(result, scratch)
        except OSError as exc:
            raise cliargs.cannot_write(args.report, exc, "--report") from None
        _progress(f"report written to {args.report}: {', '.join(files)}")
    if args.json:
        print(json.dumps(result))
    else:
        for q in result["questions"]:
            print(f"{q['verdict']:<13} {q['id']:<40} {q['finding']}")
        print("safe settings:")
        for s in result["settings"]:
            print(f"  {s['setting']}")
    _progress(f"done in {time.monotonic() - t0:.1f} s")
    return 0
