# Packages are found by setuptools, never listed by hand: calexec/ itself, and each top-level
# layer folder (contracts/, machines/, drivers/) with every subpackage under it, installed as
# calexec.<layer>[.<sub>] through the package-dir mapping.
#
# Compiled by cffi in API mode at install time: the bundled CalRT emulator, and the allocation
# counter used by the benchmarks (§13.3 allocation counts), and the host-side native helpers
# (the fused logits postprocess, drivers/native_build.py).
from setuptools import find_packages, setup

LAYERS = ("contracts", "machines", "drivers")

packages = ["calexec", *(f"calexec.{p}" for p in find_packages("calexec"))]
for layer in LAYERS:
    packages += [f"calexec.{layer}", *(f"calexec.{layer}.{p}" for p in find_packages(layer))]

setup(packages=packages,
      package_dir={"calexec": "calexec", **{f"calexec.{layer}": layer for layer in LAYERS}},
      cffi_modules=["drivers/calrt/build_ffi.py:ffibuilder",
                    "drivers/alloccount_build.py:ffibuilder",
                    "drivers/native_build.py:ffibuilder"])
