"""``calexec golden record --calbin X [--manifest M] [--out F]``: pin a calbin's §9.2 golden.

Starts an executor on the runtime (default: the bundled emulator) with ``calbin`` and the
manifest, runs the fixed warm-up (``ExecutorConfig.golden_tokens``, ``golden_decode_steps``),
and writes the tokens to the goldens file next to the manifest (``<stem>.goldens.toml``,
contracts/goldens.py; ``--out`` overrides), replacing any entry for the same calbin and prompt.
From then on warm-up compares against this pin, and a start or model switch to a calbin
without one is refused unless ``allow_unpinned_golden`` is set.

Record on the runtime that will serve: the golden is what *this* runtime computes.
Exit status: 0 recorded; 2 a bad flag (one line naming it, before anything runs: the paths,
the library's load, the device config's keys, an ``--out`` that cannot be updated); 3 a
runtime refusal, as ``calexec serve --calbin`` answers it: a ``--calbin`` the runtime's loader
refuses or the manifest does not describe (one line naming it, before the warm-up), or the
executor did not start (its Status printed).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import attrs

from calexec import cliargs
from calexec.contracts.goldens import (
    NO_GOLDENS,
    GoldenFileError,
    PinnedGolden,
    goldens_path,
    load_goldens,
    pin,
)
from calexec.contracts.manifest import ManifestError, default_manifest_path, load_manifest
from calexec.contracts.status import Status
from calexec.drivers.device_spec import DeviceSpec, with_emulated_latency


class _RecordingUnpinned(logging.Filter):
    """Drops the executor's ``allow_unpinned_golden: ... goes Ready on an unpinned golden``
    WARNING while :func:`record` runs: recording is what pins that golden."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("allow_unpinned_golden:")


def record(calbin: str, manifest_path: str | Path, runtime_lib: str | None = None,
           device_config: str = "", note: str = "") -> PinnedGolden | Status:
    """Run the warm-up of ``calbin`` once (no pinned golden consulted) and return its golden,
    or the Status that kept the executor from starting."""
    from calexec.drivers.calrt.runtime import CalRT
    from calexec.machines.executor import DeviceExecutor, ExecutorConfig

    manifest = attrs.evolve(load_manifest(manifest_path), goldens=NO_GOLDENS)
    config = with_emulated_latency(ExecutorConfig(
        calbin_path=str(calbin), device_config=device_config, allow_unpinned_golden=True))
    ex = DeviceExecutor(CalRT.load(runtime_lib), manifest, config)
    quiet = _RecordingUnpinned()  # the warm-up trusts its first run: that is what is recorded
    executor_log = logging.getLogger("calexec.executor")
    executor_log.addFilter(quiet)
    try:
        status = ex.start()
    finally:
        executor_log.removeFilter(quiet)
    try:
        if not status.ok:
            return status
        if ex.gen is None:  # (started: it has one)
            raise RuntimeError("the executor started without a generation")
        sha = ex.gen.sha256
        return PinnedGolden(sha, config.golden_tokens, config.golden_decode_steps,
                            ex.goldens[sha], note)
    finally:
        ex.shutdown(10.0)


def _default_note(calbin: str) -> str:
    """``recorded from NAME``: the calbin's file name, a byte of it that is not UTF-8 shown
    as U+FFFD (the note is text in a UTF-8 file; the sha256 names the calbin)."""
    name = os.fsencode(Path(calbin).name).decode("utf-8", "replace")
    return f"recorded from {name}"


def _check_out(out: Path) -> None:
    """Refuse an ``--out`` that cannot be updated before the warm-up runs: a directory, a file
    that is no goldens file, a missing parent directory. Raises UserError."""
    try:
        if out.is_dir():
            raise OSError(f"{out} is a directory")
        if not out.parent.is_dir():
            raise OSError(f"no directory {str(out.parent)!r}")
        load_goldens(out)  # an existing file must be one pin() can merge into
    except (OSError, GoldenFileError) as exc:
        raise cliargs.UserError(f"--out={str(out)!r}: cannot update it: "
                                f"{getattr(exc, 'strerror', None) or exc}") from None


@cliargs.command_main
def main(argv: list[str]) -> int:
    """Entry point; ``argv`` starts with the command words ``golden record``."""
    parser = cliargs.parser("calexec golden record", __doc__)
    parser.add_argument("--calbin", required=True, help="calbin file to run")
    parser.add_argument("--manifest", default=str(default_manifest_path()),
                        help="manifest the calbin is resolved against (default: the packaged "
                             "qwen3_synthetic.toml)")
    parser.add_argument("--out", type=cliargs.output_file, default=None,
                        help="goldens file to update (default: <manifest stem>.goldens.toml)")
    parser.add_argument("--runtime-lib", default=None,
                        help="calrt.h library to load (default: the bundled emulator)")
    parser.add_argument("--device-config", default="", help="device config string")
    parser.add_argument("--note", default=None, type=cliargs.utf8_text,
                        help="free text stored with the golden")
    args = parser.parse_args(argv[2:] if argv[:2] == ["golden", "record"] else argv[1:])
    # every flag is checked before the warm-up runs: the paths, the library's load, the device
    # config's keys (one line naming the flag, exit 2; DeviceSpecError through command_main)
    spec = DeviceSpec(manifest_path=args.manifest, calbin_path=args.calbin,
                      runtime_lib=args.runtime_lib)
    spec.check()
    spec.check_device_config(spec.runtime(), args.device_config)
    cliargs.check_calbin(spec)  # (before the warm-up: exit 3 naming --calbin)
    if args.out is not None and args.out.endswith(("/", os.sep)):  # (Path() drops the slash:
        # `--out dir/` wrote the goldens into a new file named `dir`)
        raise cliargs.UserError(f"--out={args.out!r}: names a directory; give the goldens "
                                "file to update (e.g. model.goldens.toml)")
    out = Path(args.out) if args.out is not None else goldens_path(args.manifest)
    _check_out(out)
    try:
        golden = record(args.calbin, args.manifest, args.runtime_lib, args.device_config,
                        args.note if args.note is not None else _default_note(args.calbin))
    except (ManifestError, OSError) as exc:
        raise cliargs.UserError(str(exc)) from None
    if isinstance(golden, Status):
        raise cliargs.UserError(f"executor did not start: {golden}", cliargs.EXIT_REFUSED)
    try:
        pin(out, golden)
    except (OSError, GoldenFileError) as exc:
        raise cliargs.UserError(f"--out={str(out)!r}: cannot update it: "
                                f"{getattr(exc, 'strerror', None) or exc}") from None
    print(f"pinned golden for calbin sha256 {golden.calbin_sha256}: tokens {list(golden.tokens)} "
          f"(prompt of {len(golden.prompt)} tokens, {golden.decode_steps} decode steps) -> "
          f"{cliargs.shell_word(out)}")
    return 0
