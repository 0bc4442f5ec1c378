# Compiled by cffi in API mode at install time: the bundled CalRT emulator, and the allocation
# counter used by the benchmarks (§13.3 allocation counts), and the host-side native helpers
# (the fused logits postprocess, drivers/native_build.py).
from setuptools import setup

setup(cffi_modules=["drivers/calrt/build_ffi.py:ffibuilder",
                    "drivers/alloccount_build.py:ffibuilder",
                    "drivers/native_build.py:ffibuilder"])
