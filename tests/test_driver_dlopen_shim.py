"""The dlopen path reaches the named library, not the bundled emulator.

A minimal shim that implements only ``calrt_version`` (and none of the emulator controls) is
compiled into the test's tmp dir; ``CalRT.load(path)`` must report its version and see no
emulator controls. (An earlier driver resolved dlopen'ed names to the bundled emulator's own
functions through the API-mode ffi, so a vendor shim would have been silently ignored.)"""

import subprocess

from calexec.drivers.calrt.runtime import CalRT

SHIM = r'''
const char *calrt_version(void) { return "shim-1"; }
'''


def test_dlopen_reaches_the_named_library(tmp_path):
    src = tmp_path / "shim.c"
    src.write_text(SHIM)
    lib = tmp_path / "libshim.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    rt = CalRT.load(str(lib))
    assert rt.version == "shim-1"
    assert rt.has_emu is False
    assert CalRT.load().version != "shim-1"  # the bundled emulator is untouched
