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


LOADER_SHIM = r'''
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <stdlib.h>
struct calrt_device { int unused; };
struct calrt_calbin { int unused; };
static struct calrt_device device;
static char last[4096];
const char *calrt_version(void) { return "shim-loader-1"; }
int32_t calrt_device_open(const char *config, struct calrt_device **out) {
    (void)config; *out = &device; return 0;
}
int32_t calrt_device_close(struct calrt_device *dev) { (void)dev; return 0; }
int32_t calrt_calbin_load(struct calrt_device *dev, const char *path, struct calrt_calbin **out) {
    (void)dev; snprintf(last, sizeof last, "%s", path);
    *out = malloc(sizeof(struct calrt_calbin)); return *out ? 0 : 1;
}
int32_t calrt_calbin_unload(struct calrt_calbin *calbin) { free(calbin); return 0; }
const char *shim_last_path(void) { return last; }
'''


def test_a_vendor_shims_loader_is_given_the_files_name_not_a_descriptor(tmp_path):
    """Found at stop 71 (the review probe, recommended; done by the lead): since a reload's
    calbin is loaded from the file held open (``/proc/self/fd/N``, so a FIFO swapped in cannot
    hold the switch), a vendor shim's ``calrt_calbin_load`` was handed that descriptor path,
    which ``calrt.h`` does not promise stays valid once the load returns (a loader reading
    lazily, looking for files beside it or logging the path). A shim (no emulator controls)
    is given the file's own name again; the hash still reads the file held open."""
    import cffi

    src = tmp_path / "loader.c"
    src.write_text(LOADER_SHIM)
    lib = tmp_path / "libloader.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    rt = CalRT.load(str(lib))
    assert rt.has_emu is False
    calbin = tmp_path / "model.calbin"
    calbin.write_bytes(b"calbin bytes")
    rc, device = rt.open_device("")
    assert rc == 0 and device is not None
    rc, loaded = device.load_calbin(str(calbin))
    assert rc == 0 and loaded is not None
    ffi = cffi.FFI()
    ffi.cdef("const char *shim_last_path(void);")
    given = ffi.string(ffi.dlopen(str(lib)).shim_last_path()).decode()
    assert given == str(calbin), given
    import hashlib
    assert loaded.sha256 == hashlib.sha256(b"calbin bytes").hexdigest()
