"""``calexec golden record --calbin X [--manifest M] [--out F]``: pin a calbin's §9.2 golden.

Starts an executor on the runtime (default: the bundled emulator) with ``calbin`` and the
manifest, runs the fixed warm-up (``ExecutorConfig.golden_tokens``, ``golden_decode_steps``),
and writes the tokens to the goldens file next to the manifest (``<stem>.goldens.toml``,
contracts/goldens.py; ``--out`` overrides), replacing any entry for the same calbin and prompt.
From then on warm-up compares against this pin, and a start or model switch to a calbin
without one is refused unless ``allow_unpinned_golden`` is set.

Record on the runtime that will serve: the golden is what *this* runtime computes.
Exit status: 0 recorded, 1 the executor did not start (Status printed), 2 usage error.
"""

from __future__ import annotations

import sys
from pathlib import Path

import attrs

from calexec import cliargs
from calexec.contracts.goldens import NO_GOLDENS, PinnedGolden, goldens_path, pin
from calexec.contracts.manifest import ManifestError, default_manifest_path, load_manifest
from calexec.contracts.status import Status


def record(calbin: str, manifest_path: str | Path, runtime_lib: str | None = None,
           device_config: str = "", note: str = "") -> PinnedGolden | Status:
    """Run the warm-up of ``calbin`` once (no pinned golden consulted) and return its golden,
    or the Status that kept the executor from starting."""
    from calexec.drivers.calrt.runtime import CalRT
    from calexec.machines.executor import DeviceExecutor, ExecutorConfig

    manifest = attrs.evolve(load_manifest(manifest_path), goldens=NO_GOLDENS)
    config = ExecutorConfig(calbin_path=str(calbin), device_config=device_config,
                            allow_unpinned_golden=True)
    ex = DeviceExecutor(CalRT.load(runtime_lib), manifest, config)
    status = ex.start()
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


def main(argv: list[str]) -> int:
    """Entry point; ``argv`` starts with the command words ``golden record``."""
    parser = cliargs.parser("calexec golden record", __doc__)
    parser.add_argument("--calbin", required=True, help="calbin file to run")
    parser.add_argument("--manifest", default=str(default_manifest_path()),
                        help="manifest the calbin is resolved against (default: the packaged "
                             "qwen3_synthetic.toml)")
    parser.add_argument("--out", type=Path, default=None,
                        help="goldens file to update (default: <manifest stem>.goldens.toml)")
    parser.add_argument("--runtime-lib", default=None,
                        help="calrt.h library to load (default: the bundled emulator)")
    parser.add_argument("--device-config", default="", help="device config string")
    parser.add_argument("--note", default=None, help="free text stored with the golden")
    args = parser.parse_args(argv[2:] if argv[:2] == ["golden", "record"] else argv[1:])
    if not Path(args.calbin).is_file():
        print(f"calexec golden record: --calbin {args.calbin!r}: no such file", file=sys.stderr)
        return 2
    try:
        golden = record(args.calbin, args.manifest, args.runtime_lib, args.device_config,
                        args.note if args.note is not None else f"recorded from {Path(args.calbin).name}")
    except (ManifestError, OSError) as exc:
        print(f"calexec golden record: {exc}", file=sys.stderr)
        return 2
    if isinstance(golden, Status):
        print(f"calexec golden record: executor did not start: {golden}", file=sys.stderr)
        return 1
    out = args.out if args.out is not None else goldens_path(args.manifest)
    pin(out, golden)
    print(f"pinned golden for calbin sha256 {golden.calbin_sha256}: tokens {list(golden.tokens)} "
          f"(prompt of {len(golden.prompt)} tokens, {golden.decode_steps} decode steps) -> {out}")
    return 0
