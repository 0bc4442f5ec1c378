"""What the CLI probe of stop 64 found in the command-line entry points, each pinned
(docs/traceability.md, "Found at stop 64 (cli)")."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

from calexec import cli
from calexec.contracts.manifest import default_manifest_path, load_manifest
from calexec.drivers import calrt as calrt_pkg
from calexec.drivers.calrt.runtime import CalRT
from calexec.drivers.device_spec import DeviceSpec
from calexec.drivers.synthetic import calbin as synthetic
from calexec.drivers.tools.accept.gate_rig import unpinned_golden
from calexec.machines.executor import DeviceExecutor, ExecutorConfig

CALRT_DIR = os.path.dirname(calrt_pkg.__file__)  # drivers/calrt: Makefile and the C sources


def _emulator_library(build: Path, directory: Path) -> str:
    """The bundled emulator built as a calrt.h shared library (in ``build``: make takes no
    space in its path), copied into ``directory``: what a ``--runtime-lib`` names."""
    subprocess.run(["make", "-s", "-C", CALRT_DIR, "lib", f"O={build}"], check=True,
                   capture_output=True, timeout=300)
    return shutil.copy(build / "libcalrt_emu.so", directory / "libcalrt_emu.so")


def test_an_unpinned_golden_on_a_runtime_library_names_it_in_the_command_to_record(tmp_path):
    """``calexec serve --runtime-lib L --calbin m5.calbin`` (or the executor on
    ``$CALEXEC_CALRT_LIB``) before the golden is pinned said ``run `calexec golden record
    --calbin m5.calbin` ...``: typed as given, that command pins what the *bundled emulator*
    computes (the golden is the runtime's), never the library's. The command named carries
    ``--runtime-lib L`` (shell-quoted: the directory has a space), and run as named it makes the
    start pass; on the bundled emulator it names none."""
    where = tmp_path / "my dir"
    where.mkdir()
    lib = str(_emulator_library(tmp_path / "build", where))
    calbin, manifest = where / "m5.calbin", where / "my.toml"
    synthetic.write(str(calbin), synthetic.default_spec(seed=5))
    manifest.write_text(Path(default_manifest_path()).read_text(encoding="utf-8"),
                        encoding="utf-8")

    def start(runtime: CalRT) -> tuple[bool, str]:
        executor = DeviceExecutor(runtime, load_manifest(manifest),
                                  ExecutorConfig(calbin_path=str(calbin)))
        try:
            status = executor.start()
            return status.ok, status.message
        finally:
            executor.shutdown(10.0)

    ok, message = start(CalRT.load(lib))
    assert not ok
    said = re.search(r"run `calexec (golden record [^`]*)`", message)
    assert said is not None, message
    assert said[1].endswith(f" --runtime-lib {shlex.quote(lib)}"), message
    assert cli.main(shlex.split(said[1])) == 0  # the command as the message names it
    ok, message = start(CalRT.load(lib))
    assert ok, message
    ok, message = start(CalRT.load())
    assert "--runtime-lib" not in message, message


def test_accept_names_the_runtime_library_and_quotes_the_paths_of_the_command_to_record(
        tmp_path):
    """``calexec accept --calbin X --manifest M --runtime-lib L`` on a calbin with no pinned
    golden said ``run `calexec golden record --calbin X` --manifest M first``: the closing
    backtick before ``--manifest``, no ``--runtime-lib`` (the golden recorded as named is the
    bundled emulator's, and the gates still refused), the paths unquoted (a space made two
    words). The command is now whole between the backticks, quoted, with the library."""
    where = tmp_path / "my dir"
    where.mkdir()
    calbin, manifest, lib = where / "m5.calbin", where / "my.toml", str(where / "libx.so")
    synthetic.write(str(calbin), synthetic.default_spec(seed=5))
    manifest.write_text(Path(default_manifest_path()).read_text(encoding="utf-8"),
                        encoding="utf-8")
    line = unpinned_golden(str(calbin), DeviceSpec(manifest_path=str(manifest),
                                                   calbin_path=str(calbin), runtime_lib=lib))
    assert line is not None
    said = re.search(r"run `calexec (golden record [^`]*)` first$", line)
    assert said is not None, line
    assert shlex.split(said[1]) == ["golden", "record", "--calbin", str(calbin), "--manifest",
                                    str(manifest), "--runtime-lib", lib]
    line = unpinned_golden(str(calbin), DeviceSpec(calbin_path=str(calbin)))
    assert line is not None and line.endswith(
        f"run `calexec golden record --calbin {shlex.quote(str(calbin))}` first"), line
