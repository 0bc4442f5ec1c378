"""CalRT C ABI (calrt.h), the bundled C emulator and its cffi build."""
