"""``calexec serve``: the reference HTTP server on the bundled emulator (or a vendor shim).

Exit codes: 0 after a clean drain (SIGTERM/SIGINT or ``POST /admin/drain``); 2 for bad
arguments or configuration; 3 when the executor failed to start or ended ``Failed`` (for
example work did not drain within ``--grace``). The library never exits the process; this
module's ``main`` returns the code to the console script.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
from pathlib import Path

import uvicorn

from calexec.contracts.manifest import default_manifest_path, load_manifest
from calexec.drivers import calbin
from calexec.drivers.dumpsink import DumpConfigError, DumpSink
from calexec.drivers.runtime import CalRT
from calexec.drivers.server import DrainingServer, ServerConfig, create_app
from calexec.machines.executor import DeviceExecutor, ExecutorConfig

EXIT_OK, EXIT_USAGE, EXIT_FAILED = 0, 2, 3


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="calexec serve", description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    p.add_argument("--calbin", help="calbin to serve (default: the synthetic calbin, written "
                                    "to a temporary directory)")
    p.add_argument("--runtime-lib", help="CalRT shim library to dlopen (default: the bundled "
                                         "emulator)")
    p.add_argument("--device-config", default="", help="device config string, e.g. "
                   "'kv_blocks=64;decode_us=10000' (emulator keys: drivers/calrt/calrt_emu.h)")
    p.add_argument("--admin-token-file", type=Path, help="file holding the admin bearer "
                   "token; without it the admin endpoints are disabled")
    p.add_argument("--grace", type=float, default=30.0, help="drain grace in seconds")
    p.add_argument("--max-sequences", type=int, default=32, help="KV sequence ids to lease")
    p.add_argument("--timeout", type=float, default=30.0, help="default request deadline (s)")
    p.add_argument("--dump-dir", type=Path, help="enable the dump sink in this directory")
    p.add_argument("--dump-max-bytes", type=int, default=16 << 20, help="dump size cap")
    p.add_argument("--dump-prompts", action="store_true",
                   help="also dump prompt and completion content (off by default)")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    return p


def _admin_token(path: Path | None) -> str | None:
    if path is None:
        return None
    token = path.read_text(encoding="utf-8").strip()
    if not token:
        raise ValueError(f"--admin-token-file={str(path)!r} is empty")
    return token


def main(argv: list[str]) -> int:
    """Entry point; ``argv`` starts with the command word ``serve``."""
    args = _parser().parse_args(argv[1:])
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        token = _admin_token(args.admin_token_file)
        dump = None if args.dump_dir is None else DumpSink(
            args.dump_dir.absolute(), args.dump_max_bytes, include_content=args.dump_prompts)
        config = ServerConfig(admin_token=token, max_sequences=args.max_sequences,
                              default_timeout_s=args.timeout)
    except (OSError, ValueError, DumpConfigError) as err:
        print(f"calexec serve: {err}", file=sys.stderr)
        return EXIT_USAGE
    with tempfile.TemporaryDirectory(prefix="calexec-serve-") as tmp:
        path = args.calbin
        if path is None:
            path = os.path.join(tmp, "synthetic.calbin")
            calbin.write(path, calbin.default_spec())
        executor = DeviceExecutor(CalRT.load(args.runtime_lib),
                                  load_manifest(default_manifest_path()),
                                  ExecutorConfig(calbin_path=path,
                                                 device_config=args.device_config))
        status = executor.start()
        if not status.ok:
            print(f"calexec serve: executor failed to start: {status}", file=sys.stderr)
            return EXIT_FAILED
        app = create_app(executor, config, dump)
        server = DrainingServer(uvicorn.Config(app, host=args.host, port=args.port,
                                               log_level=args.log_level, access_log=False),
                                app.state.service, args.grace)
        server.run()
        service = app.state.service
        if service.drain_status is None:  # left the loop without a drain (failed executor)
            status = executor.shutdown(args.grace)
        else:
            status = service.drain_status
        if not status.ok or executor.state != "Stopped":
            print(f"calexec serve: executor ended {executor.state}: {status}", file=sys.stderr)
            return EXIT_FAILED
        return EXIT_OK
