"""cffi build of ``calexec.drivers.native._calexec_native``: host-side native helpers (API
mode).

Today one function, the fused logits postprocess ``calexec_bf16_logits`` (spec §10.1, S10,
FI10; ``native/calexec_native.h`` documents it). It is host code run by the completion thread,
not part of the CalRT ABI, so it lives in its own module rather than in the emulator's
``_calrt_emu``: it is then available whichever CalRT is loaded (the bundled emulator or a
vendor shim through ``ffi.dlopen``, whose cdef is exactly ``calrt.h``), and the CalRT headers
stay the runtime's contract only. cffi releases the GIL around every call into an API-mode
module (verified by ``tests/test_native_logits.py`` through ``calexec_native_gil_held``).

Run by setuptools (``cffi_modules`` in setup.py) at ``pip install -e .``. The C file is also
built on its own under ASan+UBSan by ``make -C drivers/calrt check-sanitizers``
(``native/check.c``).
"""

from __future__ import annotations

import os

from cffi import FFI

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "native")
HEADERS = ("calexec_native.h", "calexec_relay.h")
SOURCES = ("calexec_native.c", "calexec_relay.c")
# -Wno-psabi: the eight-lane helpers are always inlined; GCC still notes that an AVX vector
# returned without AVX (the SSE2 clone) would change an ABI none of them has.
WARNINGS = ["-Wall", "-Wextra", "-Werror", "-Wno-psabi"]
# -ffp-contract=fast: fused multiply-adds in the exp polynomial of the AVX2 clone (only the
# optional sum of exponentials uses floating-point arithmetic; conversion and argmax are
# integer operations, exact whatever the flags).
OPTIMISE = ["-O3", "-std=c11", "-ffp-contract=fast"]


def cdef_text() -> str:
    """The header without preprocessor lines (the header is the single source of the cdef)."""
    text = []
    for header in HEADERS:
        with open(os.path.join(HERE, header), encoding="utf-8") as f:
            text += [line for line in f if not line.lstrip().startswith("#")]
    return "".join(text)


def _source_path(name: str) -> str:
    # setuptools wants paths relative to the project root it runs from.
    path = os.path.join(HERE, name)
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


ffibuilder = FFI()
ffibuilder.cdef(cdef_text() + "int calexec_native_gil_held(void);\n")
ffibuilder.set_source(
    "calexec.drivers.native._calexec_native",
    # a test hook: 1 iff the calling thread holds the GIL while inside a call of this module
    '#include "calexec_native.h"\n#include "calexec_relay.h"\n'
    "static int calexec_native_gil_held(void) { return PyGILState_Check(); }\n",
    sources=[_source_path(s) for s in SOURCES],
    include_dirs=[HERE],
    extra_compile_args=[*OPTIMISE, "-fvisibility=hidden", *WARNINGS],
    libraries=["m"],
    # PyGILState_Check (the test hook) is not in the limited API cffi defaults to
    py_limited_api=False, define_macros=[("_CFFI_NO_LIMITED_API", None)],
)

if __name__ == "__main__":  # pragma: no cover - manual build
    ffibuilder.compile(verbose=True)
