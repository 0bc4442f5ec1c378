"""cffi build of the bundled CalRT emulator (API mode) and the shared cdef.

``calrt.h`` and ``calrt_emu.h`` are the single source of the C ABI: this module drops their
preprocessor lines and hands the rest to ``ffi.cdef``. The compiled module
``calexec.drivers.calrt._calrt_emu`` therefore carries an ``ffi`` whose declarations also
serve ``ffi.dlopen()`` of a vendor shim (see ``calexec.drivers.calrt.runtime``).

Run by setuptools (``cffi_modules`` in setup.py) at ``pip install -e .``.
"""

from __future__ import annotations

import os

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))
HEADERS = ("calrt.h", "calrt_emu.h")
SOURCES = ("emulator.c", "emu_controls.c", "emu_engine.c")


def cdef_text() -> str:
    """The cdef: both headers without preprocessor lines (comments are stripped by cffi)."""
    parts: list[str] = []
    for name in HEADERS:
        with open(os.path.join(HERE, name), encoding="utf-8") as f:
            parts.extend(line for line in f if not line.lstrip().startswith("#"))
    return "".join(parts)


def _source_path(name: str) -> str:
    # setuptools wants paths relative to the project root it runs from.
    path = os.path.join(HERE, name)
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


ffibuilder = FFI()
ffibuilder.cdef(cdef_text())
ffibuilder.set_source(
    "calexec.drivers.calrt._calrt_emu",
    '#include "calrt.h"\n#include "calrt_emu.h"\n',
    sources=[_source_path(s) for s in SOURCES],
    include_dirs=[HERE],
    extra_compile_args=["-O3", "-std=c11", "-pthread", "-fvisibility=hidden"],
    extra_link_args=["-pthread"],
)

if __name__ == "__main__":  # pragma: no cover - manual build
    ffibuilder.compile(verbose=True)
