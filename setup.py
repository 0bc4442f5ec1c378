# The bundled CalRT emulator is compiled by cffi in API mode at install time.
from setuptools import setup

setup(cffi_modules=["drivers/calrt/build_ffi.py:ffibuilder"])
