"""The cffi CalRT driver: thin Python objects over the C ABI of ``calrt/calrt.h``.

Two loaders, one cdef: ``CalRT.load(None)`` uses the bundled emulator compiled in API mode
(``calexec.drivers.calrt._calrt_emu``) unless ``CALEXEC_CALRT_LIB`` names a library;
``CalRT.load(path)`` opens a vendor shim (or ``libcalrt_emu.so``) with ``ffi.dlopen`` using
the same ``ffi`` object.

Contract of every wrapper: it returns the raw CalRT integer code (``int``; 0 success), or a
tuple whose first item is that code; it never raises for a runtime failure and never hides a
code. Python-side misuse (a non-contiguous array, an unsupported numpy dtype) raises
``ValueError`` naming the bad field, before anything reaches the runtime. Handles stay
valid until destroyed or the device is closed; a stale handle yields code 4, never a crash.

Each object keeps preallocated out-parameters so the hot path (``infer``, ``wait``,
``get_status``) allocates nothing beyond what cffi needs; the getters of one object are
therefore meant for one owner thread at a time (the completion thread owns a submitted
output buffer, spec section 5.1).
"""

from __future__ import annotations

import enum
import hashlib
import logging
import os
import stat
from typing import Any

import numpy as np

from calexec.contracts.runtime_view import RuntimeModelInfo, RuntimeTensorInfo
from calexec.drivers.calrt._calrt_emu import ffi as _ffi
from calexec.drivers.calrt._calrt_emu import lib as _emu_lib
from calexec.drivers.native.fused_logits import FusedLogits
from calexec.drivers.native.relay import Kind, NativeRelay, RelayEvent, RelayFunctions, RelayJob

#: fault injection (the emulator's fault plan): every armed point is logged here, marked
#: INJECTED, so an injected fault is never mistaken for a real one in a log
inject_log = logging.getLogger("calexec.injected")
log = logging.getLogger("calexec.calrt")

ENV_LIB = "CALEXEC_CALRT_LIB"


def _enum(name: str, ctype: str, prefix: str) -> Any:
    """An IntEnum built from a C enum of the cdef (the header stays the single source). Typed
    ``Any``: its members exist only once the cdef is read, so a type checker cannot list them
    (a wrong member name is an AttributeError at import or first use, as before)."""
    members = {k[len(prefix):]: v for k, v in _ffi.typeof(ctype).relements.items() if k.startswith(prefix)}
    return enum.IntEnum(name, sorted(members.items(), key=lambda kv: kv[1]))


Rc = _enum("Rc", "calrt_rc", "CALRT_")  # Rc.SUCCESS, Rc.ERR_TIMEOUT, ...
DType = _enum("DType", "calrt_dtype", "CALRT_DTYPE_")
TaskType = _enum("TaskType", "calrt_task_type", "CALRT_TASK_")
JobStatus = _enum("JobStatus", "calrt_job_status", "CALRT_JOB_")
Overlap = _enum("Overlap", "calrt_emu_overlap", "CALRT_EMU_OVERLAP_")
KvPolicy = _enum("KvPolicy", "calrt_emu_kv_policy", "CALRT_EMU_KV_")
Scope = _enum("Scope", "calrt_emu_scope", "CALRT_EMU_SCOPE_")
Fault = _enum("Fault", "calrt_emu_fault_point", "CALRT_EMU_FAULT_")
FaultMode = _enum("FaultMode", "calrt_emu_fault_mode", "CALRT_EMU_MODE_")
Stage = _enum("Stage", "calrt_emu_stage", "CALRT_EMU_STAGE_")
Did = _enum("Did", "calrt_emu_did", "CALRT_EMU_DID_")

# numpy dtype of host memory -> CalRT dtype (BF16 travels as uint16 bits).
_NP_TO_DTYPE = {
    np.dtype(np.uint8): DType.U8,
    np.dtype(np.int32): DType.S32,
    np.dtype(np.float32): DType.F32,
    np.dtype(np.uint16): DType.BF16,
    np.dtype(np.float16): DType.F16,
    np.dtype(np.int64): DType.S64,
}


def dtype_name(code: int) -> str:
    """calexec.contracts dtype name of a CalRT dtype code ("S32", "BF16", ...)."""
    try:
        return DType(code).name
    except ValueError:
        return f"UNKNOWN_{code}"


def _host(ffi, arr: np.ndarray, what: str):
    if not isinstance(arr, np.ndarray):
        raise ValueError(f"{what}: expected a numpy array, got {type(arr).__name__}")
    if not arr.flags.c_contiguous:
        raise ValueError(f"{what}: array must be C-contiguous (it is mapped, not copied)")
    code = _NP_TO_DTYPE.get(arr.dtype)
    if code is None:
        raise ValueError(f"{what}: unsupported numpy dtype {arr.dtype}")
    return ffi.from_buffer(arr), int(code), arr.nbytes


_ABI_FFI = None


def _abi_ffi():
    """The ABI-mode FFI for ``dlopen`` of an external implementation (one per process)."""
    global _ABI_FFI
    if _ABI_FFI is None:
        from cffi import FFI

        from calexec.drivers.calrt.build_ffi import cdef_text

        ffi = FFI()
        ffi.cdef(cdef_text())
        _ABI_FFI = ffi
    return _ABI_FFI


def _as_path(lib_path: str) -> str:
    """What to ``dlopen`` for ``lib_path``: a bare file name (``libcalrt.so``, no directory) of
    a file in the current directory as that file (``./libcalrt.so``): dlopen looks a name
    without a ``/`` up in the system's library path only, never in the current directory, so
    the file the flag names, which exists, was 'No such file or directory'. Any other
    value (a path, a library name of the system's path) as given."""
    if os.sep in lib_path or (os.altsep and os.altsep in lib_path):
        return lib_path
    return os.path.join(os.curdir, lib_path) if os.path.isfile(lib_path) else lib_path


class CalRT:
    """A loaded CalRT library (the bundled emulator or a dlopen'ed shim)."""

    def __init__(self, lib, path: str | None, ffi=_ffi) -> None:
        self.ffi = ffi
        self.lib = lib
        self.path = path  # None for the bundled API-mode module
        self.version = ffi.string(lib.calrt_version()).decode()
        try:
            lib.calrt_emu_get_counters  # noqa: B018 - probing for the emulator controls
            self.has_emu = True
        except AttributeError:
            self.has_emu = False

    @classmethod
    def load(cls, lib_path: str | None = None) -> CalRT:
        """lib_path None: ``$CALEXEC_CALRT_LIB`` if set, else the bundled emulator."""
        if lib_path is None:
            lib_path = os.environ.get(ENV_LIB) or None
        if lib_path is None:
            return cls(_emu_lib, None)
        # A plain (ABI-mode) FFI with the same cdef: the API-mode module's ffi.dlopen would
        # resolve the names to the bundled emulator's own functions, not the library's.
        ffi = _abi_ffi()
        return cls(ffi.dlopen(_as_path(lib_path)), lib_path, ffi)

    def function_address(self, name: str) -> int:
        """The address of the library's function ``name`` (a ``calrt.h`` entry point), for
        host native code that calls the runtime itself (the relay, drivers/native/relay.py)."""
        return int(self.ffi.cast("uintptr_t", self.ffi.addressof(self.lib, name)))

    def relay_functions(self) -> RelayFunctions:
        """What the native relay calls (drivers/native/relay.py): this library's infer, Wait,
        GetStatus and valid-bytes entry points and its DONE status."""
        return RelayFunctions(infer=self.function_address("calrt_infer"),
                              wait=self.function_address("calrt_wait"),
                              status=self.function_address("calrt_get_status"),
                              valid_bytes=self.function_address("calrt_outputbuf_valid_bytes"),
                              done_status=int(JobStatus.DONE))

    def submit_relay(self, clock: object) -> NativeSubmitRelay | None:
        """The executor's submit relay (``ExecutorConfig.native_relay``; machines/device_api.py
        ``SubmitRelay``): a submitter-only native relay on this library's entry points.
        None for a clock whose time is not the host's (``clock.real`` false: the explorer's
        virtual clock), which a wait in C cannot follow."""
        if not getattr(clock, "real", False):
            return None
        return NativeSubmitRelay(NativeRelay(self.relay_functions(), submitter_only=True))

    def logits_postprocessor(self) -> FusedLogits:
        """A new fused native logits postprocess (drivers/native/fused_logits.py) for the
        executor's completion path. Host code, not CalRT: the same whichever library is loaded."""
        return FusedLogits()

    def inspect_calbin(self, path: str) -> tuple[RuntimeModelInfo, ...] | str | None:
        """The models the calbin at ``path`` holds, as the runtime's loader reads it, or one
        line saying why it refuses the file; None when it cannot be read on the host without
        the serving device (a vendor shim: a second device is real hardware). On the emulator
        the loader is run on a scratch device of its own (opened, loaded, unloaded, closed:
        the serving device, its faults and its counters are not touched), so the check and the
        switch read a file with the same code. ``DeviceExecutor.check_calbin`` calls it (on a
        regular file) before a model switch moves the lifecycle."""
        if not self.has_emu:
            return None
        rc, device = self.open_device("")
        if device is None:  # (the emulator out of memory, say): the switch will tell
            return None
        try:
            rc, calbin = device.load_calbin(path, sha256=False)  # (the check hashes no file)
            if calbin is None:
                why = device.emu.calbin_error() if device.emu is not None else ""
                return f"the loader refused it ({_name(Rc, rc)}{': ' + why if why else ''})"
            try:
                rc, models = calbin.models()
                if rc != 0:
                    return f"its models cannot be listed ({_name(Rc, rc)})"
                try:
                    return tuple(model.info for model in models)
                except RuntimeError as err:  # (a name that is no UTF-8; introspection refused)
                    return f"its models cannot be read ({err})"
            finally:
                calbin.unload()
        finally:
            device.close()

    def open_device(self, config: str = "") -> tuple[int, Device | None]:
        out = self.ffi.new("calrt_device **")
        rc = self.lib.calrt_device_open(config.encode(), out)
        return rc, (Device(self, out[0]) if rc == 0 else None)


def _file_name(path: str) -> str:
    """``path`` as a log line names it: for ``/proc/self/fd/N`` (a reload's check gives the
    loader the file it holds open: ``switch_check``), the name the file was opened by."""
    if path.startswith("/proc/self/fd/"):
        try:
            return os.readlink(path)
        except OSError:
            pass
    return path


class Device:
    """One virtual device. ``emu`` is the emulator controls, or None for a vendor shim."""

    __slots__ = ("rt", "_lib", "_ffi", "_h", "emu")

    def __init__(self, rt: CalRT, handle: object) -> None:
        self.rt = rt
        self._lib = rt.lib
        self._ffi = rt.ffi
        self._h = handle
        self.emu = Emulator(self) if rt.has_emu else None

    @property
    def address(self) -> int:
        """The handle's address (a ``uintptr_t``), for host native code that calls the runtime
        through :meth:`CalRT.function_address` (the relay, drivers/native/relay.py)."""
        return int(self._ffi.cast("uintptr_t", self._h))

    def close(self) -> int:
        return self._lib.calrt_device_close(self._h)

    def injected_faults_fired(self) -> int | None:
        """How many injected faults the emulator's fault plan has fired (None for a vendor
        shim, which injects none): the fault controller marks a fault INJECTED in its log when
        this moved since its last report."""
        return None if self.emu is None else self.emu.injected_fired()

    def dma_quiescent(self) -> bool | None:
        """Proof that the device will write no host memory it was given before now (no stale
        completion pending, §9.2 / FI14): True or False from the emulator's counters; None
        for a vendor shim, which offers no such proof (retired host memory is then kept)."""
        if self.emu is None:
            return None
        counters = self.emu.counters()
        return bool(counters) and counters.get("stale_pending", 1) == 0

    def load_calbin(self, path: str, sha256: bool = True) -> tuple[int, Calbin | None]:
        """(rc, Calbin). The sha256 is of the file's bytes, read here once the runtime loaded
        it (a file it refuses is not read whole for nothing), in chunks: a multi-GB calbin is
        never held whole in memory (it was, ``f.read()``, beside the runtime's own copy); if
        Python cannot read the file, 11 (FILE_READ) is returned and nothing stays loaded.
        ``sha256`` False (``CalRT.inspect_calbin``, which lists the models and unloads): the
        file is not hashed, and the Calbin's ``sha256`` is "".

        A regular file is opened once without waiting (``O_NONBLOCK``) and held open while the
        runtime loads it and Python hashes it, both through ``/proc/self/fd/N`` (a new open
        of that same file, where there is a ``/proc``): the file the caller looked at
        (``stat``: a regular file, ``open_generation``; the reload's check) is the one loaded
        and hashed. Both opened the path anew until stop 71: a FIFO put at the path in
        between (a script rewriting the file a ``POST /admin/reload`` names) held the
        switch in the loader's open for ever, the lifecycle Configuring and nothing served.
        What the open finds that is no regular file (nor a directory, which the loader
        refuses at once) is answered 11 (FILE_READ) without calling the loader.

        A vendor shim (no emulator controls) is given the file's own name, not
        ``/proc/self/fd/N``: ``calrt.h`` does not say a loader reads the file only inside
        ``calrt_calbin_load``, and one that keeps the path to read later, looks for files
        beside it or logs it would find a descriptor closed once the load returned. There the
        hash still reads the file held open, and a swap between the look and the loader's open
        is the shim's to see, as before stop 71."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
        except (OSError, ValueError):  # (missing, unreadable: the runtime says which)
            return self._load(path, path, path, sha256)
        try:
            mode = os.fstat(fd).st_mode
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                log.error("calbin %r not loaded: not a regular file (mode %s), whose read may "
                          "never end", _file_name(path), stat.filemode(mode))
                return Rc.ERR_FILE_READ, None
            reopened = f"/proc/self/fd/{fd}"
            held = reopened if os.path.exists(reopened) else path
            return self._load(path, held if self.emu is not None else _file_name(path), held,
                              sha256)
        finally:
            os.close(fd)

    def _load(self, path: str, loaded: str, hashed: str,
              sha256: bool) -> tuple[int, Calbin | None]:
        """``load_calbin`` of ``path``: the runtime reading ``loaded``, the hash ``hashed``."""
        out = self._ffi.new("calrt_calbin **")
        rc = self._lib.calrt_calbin_load(self._h, os.fsencode(loaded), out)
        if rc != 0:
            why = self.emu.calbin_error() if self.emu is not None else ""
            if why:  # 0.7.6 answers 19 alone: the emulator says which dtype it refused
                log.error("calbin %r refused (%d INVALID_CALBIN): %s", _file_name(path), rc,
                          why)
            return rc, None
        sha: str | None = ""
        try:
            if sha256:
                with open(hashed, "rb") as f:
                    sha = hashlib.file_digest(f, "sha256").hexdigest()
        except OSError:
            sha = None
        if sha is None:  # readable by the runtime but not by us: do not report a generation
            self._lib.calrt_calbin_unload(out[0])
            return Rc.ERR_FILE_READ, None
        return rc, Calbin(self, out[0], sha)

    def configure(self, calbin: Calbin) -> int:
        return self._lib.calrt_configure(self._h, calbin._h)

    def enable_parallel_mode(self, on: bool) -> int:
        return self._lib.calrt_enable_parallel_mode(self._h, 1 if on else 0)

    def reset_ccu(self) -> int:
        return self._lib.calrt_reset_ccu(self._h)

    def reset_configuration(self) -> int:
        return self._lib.calrt_reset_configuration(self._h)

    def reset(self) -> int:
        return self._lib.calrt_reset(self._h)

    def create_kv(self, calbin: Calbin) -> tuple[int, KvManager | None]:
        out = self._ffi.new("calrt_kv **")
        rc = self._lib.calrt_kv_create(self._h, calbin._h, out)
        return rc, (KvManager(self, out[0]) if rc == 0 else None)

    def infer(self, model: Model, kv: KvManager, seq: int, inbuf: InputBuf, outbuf: OutputBuf) -> int:
        return self._lib.calrt_infer(self._h, model._h, kv._h, seq, inbuf._h, outbuf._h)

    def infer_with_fixed_task_type(self, model: Model, kv: KvManager, seq: int, inbuf: InputBuf,
                                   outbuf: OutputBuf, task: int) -> int:
        return self._lib.calrt_infer_with_fixed_task_type(self._h, model._h, kv._h, seq, inbuf._h, outbuf._h, task)


class Calbin:
    """A loaded calbin. ``sha256`` is of the file's bytes (identifies the generation)."""

    __slots__ = ("device", "_lib", "_ffi", "_h", "sha256")

    def __init__(self, device: Device, handle: object, sha256: str) -> None:
        self.device = device
        self._lib = device._lib
        self._ffi = device._ffi
        self._h = handle
        self.sha256 = sha256

    def models(self) -> tuple[int, list[Model]]:
        count = self._ffi.new("int32_t *")
        rc = self._lib.calrt_get_all_models(self._h, self._ffi.NULL, 0, count)
        if rc != 0:
            return rc, []
        arr = self._ffi.new("calrt_model *[]", max(count[0], 1))
        rc = self._lib.calrt_get_all_models(self._h, arr, count[0], count)
        return rc, ([Model(self, arr[i]) for i in range(count[0])] if rc == 0 else [])

    def unload(self) -> int:
        return self._lib.calrt_calbin_unload(self._h)


def _utf8(raw: bytes, what: str) -> str:
    """``raw`` (a name the runtime gives) as text; RuntimeError naming ``what`` and the bytes
    when they are not UTF-8 (no manifest names such a model, tensor, CSR or key)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise RuntimeError(f"{what} of the calbin is not UTF-8 ({err.reason} at byte "
                           f"{err.start}): {raw[:80]!r}") from None


class Model:
    """One graph of a calbin; ``info`` is its RuntimeModelInfo (read once, cached)."""

    __slots__ = ("calbin", "_lib", "_ffi", "_h", "_info")

    def __init__(self, calbin: Calbin, handle: object) -> None:
        self.calbin = calbin
        self._lib = calbin._lib
        self._ffi = calbin._ffi
        self._h = handle
        self._info: RuntimeModelInfo | None = None

    @property
    def address(self) -> int:
        """The handle's address (a ``uintptr_t``), for host native code that calls the runtime
        through :meth:`CalRT.function_address` (the relay, drivers/native/relay.py)."""
        return int(self._ffi.cast("uintptr_t", self._h))

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def info(self) -> RuntimeModelInfo:
        """Raises RuntimeError naming the code if the runtime refuses introspection, or the
        name if one it gives is not UTF-8 (a loader that takes any byte in a name: until stop
        73 the ``UnicodeDecodeError`` came out of a reload's check, a 500, and out of a model
        switch, which stayed in Configuring for good)."""
        if self._info is None:
            self._info = self._read_info()
        return self._info

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"CalRT {what} failed with code {rc}")

    def _read_info(self) -> RuntimeModelInfo:
        lib = self._lib
        buf = self._ffi.new("char[]", 256)
        n = self._ffi.new("int32_t *")
        self._check(lib.calrt_model_name(self._h, buf, 256), "model_name")
        name = _utf8(self._ffi.string(buf), "a model name")
        tinfo = self._ffi.new("calrt_tensor_info *")

        def tensors(count_fn, info_fn) -> list[RuntimeTensorInfo]:
            self._check(count_fn(self._h, n), f"{name}: tensor count")
            out = []
            for i in range(n[0]):
                self._check(info_fn(self._h, i, tinfo), f"{name}: tensor info {i}")
                out.append(RuntimeTensorInfo(
                    name=_utf8(self._ffi.string(tinfo.name), f"{name}: a tensor name"),
                    shape=[tinfo.shape[d] for d in range(tinfo.rank)],
                    dtype=dtype_name(tinfo.dtype),
                    byte_size=int(tinfo.byte_size),
                    sliceable=bool(tinfo.sliceable),
                ))
            return out

        inputs = tensors(lib.calrt_model_num_inputs, lib.calrt_model_input_info)
        outputs = tensors(lib.calrt_model_num_outputs, lib.calrt_model_output_info)
        self._check(lib.calrt_model_num_csrs(self._h, n), f"{name}: csr count")
        csrs = []
        for i in range(n[0]):
            self._check(lib.calrt_model_csr_name(self._h, i, buf, 256), f"{name}: csr {i}")
            csrs.append(_utf8(self._ffi.string(buf), f"{name}: a CSR name"))
        self._check(lib.calrt_model_num_meta(self._h, n), f"{name}: meta count")
        meta = {}
        val = self._ffi.new("int64_t *")
        for i in range(n[0]):
            self._check(lib.calrt_model_meta_at(self._h, i, buf, 256, val), f"{name}: meta {i}")
            meta[_utf8(self._ffi.string(buf), f"{name}: a meta key")] = int(val[0])
        return RuntimeModelInfo(name=name, inputs=inputs, outputs=outputs, csr_names=csrs, meta=meta)

    def meta(self, key: str) -> tuple[int, int]:
        val = self._ffi.new("int64_t *")
        rc = self._lib.calrt_model_meta(self._h, key.encode(), val)
        return rc, int(val[0]) if rc == 0 else 0

    def create_input_buf(self) -> tuple[int, InputBuf | None]:
        out = self._ffi.new("calrt_inputbuf **")
        rc = self._lib.calrt_inputbuf_create(self._h, out)
        return rc, (InputBuf(self, out[0]) if rc == 0 else None)

    def create_output_buf(self) -> tuple[int, OutputBuf | None]:
        out = self._ffi.new("calrt_outputbuf **")
        rc = self._lib.calrt_outputbuf_create(self._h, out)
        return rc, (OutputBuf(self, out[0]) if rc == 0 else None)


class InputBuf:
    """InputBuf of one model. Mapped arrays stay referenced until remap or destroy."""

    __slots__ = ("model", "_lib", "_ffi", "_h", "_arrays", "_n")

    def __init__(self, model: Model, handle: object) -> None:
        self.model = model
        self._lib = model._lib
        self._ffi = model._ffi
        self._h = handle
        self._arrays: dict[str, np.ndarray] = {}
        self._n = self._ffi.new("int32_t *")

    @property
    def address(self) -> int:
        """The handle's address (a ``uintptr_t``), for host native code that calls the runtime
        through :meth:`CalRT.function_address` (the relay, drivers/native/relay.py)."""
        return int(self._ffi.cast("uintptr_t", self._h))

    @property
    def handle(self) -> object:
        """The runtime's handle (a cffi ``calrt_inputbuf *``), for tests of the C API."""
        return self._h

    def map(self, tensor: str, arr: np.ndarray) -> int:
        """MapBuf: the device reads arr at H2D; do not write it until the job completes."""
        ptr, dtype, size = _host(self._ffi, arr, f"input tensor {tensor!r}")
        rc = self._lib.calrt_inputbuf_map(self._h, tensor.encode(), dtype, ptr, size)
        if rc == 0:
            self._arrays[tensor] = arr
        return rc

    def slice(self, tensor: str, offset_elems: int, count_elems: int) -> int:
        return self._lib.calrt_inputbuf_slice(self._h, tensor.encode(), offset_elems, count_elems)

    def undo_slice(self, tensor: str) -> int:
        return self._lib.calrt_inputbuf_undo_slice(self._h, tensor.encode())

    def set_csr(self, name: str, value: int) -> int:
        return self._lib.calrt_inputbuf_set_csr(self._h, name.encode(), value)

    def active_slices(self) -> tuple[int, int]:
        """Emulator only (UndoSlice-forgotten detection): (rc, tensors with an active slice)."""
        rc = self._lib.calrt_emu_inputbuf_active_slices(self._h, self._n)
        return rc, int(self._n[0]) if rc == 0 else 0

    def destroy(self) -> int:
        rc = self._lib.calrt_inputbuf_destroy(self._h)
        if rc == 0:
            self._arrays.clear()
        return rc


class OutputBuf:
    """OutputBuf of one model; the device writes the mapped array at D2H."""

    __slots__ = ("model", "_lib", "_ffi", "_h", "_array", "_status", "_bytes", "_copy",
                 "copy_control")

    def __init__(self, model: Model, handle: object) -> None:
        self.model = model
        self._lib = model._lib
        self._ffi = model._ffi
        self._h = handle
        self._array: np.ndarray | None = None
        self._status = self._ffi.new("int32_t *")
        self._bytes = self._ffi.new("uint64_t *")
        self._copy = self._ffi.new("int64_t[2]")
        #: the emulator's control that measures the job's copies (``copy_ms``); None on a
        #: vendor runtime (dlopen'ed), which has none
        self.copy_control = getattr(self._lib, "calrt_emu_outputbuf_copy_ns", None)

    @property
    def address(self) -> int:
        """The handle's address (a ``uintptr_t``), for host native code that calls the runtime
        through :meth:`CalRT.function_address` (the relay, drivers/native/relay.py)."""
        return int(self._ffi.cast("uintptr_t", self._h))

    def map(self, tensor: str, arr: np.ndarray) -> int:
        ptr, dtype, size = _host(self._ffi, arr, f"output tensor {tensor!r}")
        rc = self._lib.calrt_outputbuf_map(self._h, tensor.encode(), dtype, ptr, size)
        if rc == 0:
            self._array = arr
        return rc

    def wait(self, timeout_us: int) -> int:
        """Blocks in C with the GIL released. 0 done, 13 timeout (see calrt.h)."""
        return self._lib.calrt_wait(self._h, timeout_us)

    def get_status(self) -> tuple[int, int]:
        rc = self._lib.calrt_get_status(self._h, self._status)
        return rc, self._status[0]

    def valid_bytes(self) -> tuple[int, int]:
        rc = self._lib.calrt_outputbuf_valid_bytes(self._h, self._bytes)
        return rc, int(self._bytes[0])

    def copy_ms(self) -> tuple[float, float] | None:
        """(H2D, D2H) copy times in ms of the last job finished on this buffer, as the device
        measured them; 0.0 for a stage that did not run. None when the runtime cannot say:
        CalRT 0.7.6 runs both copies inside the job, between ``infer()`` and ``Wait()``, and
        exposes no timing of them (only the bundled emulator measures its own)."""
        control = self.copy_control
        if control is None or control(self._h, self._copy, self._copy + 1) != 0:
            return None
        return self._copy[0] / 1e6, self._copy[1] / 1e6

    def destroy(self) -> int:
        rc = self._lib.calrt_outputbuf_destroy(self._h)
        if rc == 0:
            self._array = None
        return rc


class KvManager:
    """The device's KvManager. can_allocate/apply are bools without a reason, as 0.7.6."""

    __slots__ = ("device", "_lib", "_ffi", "_h", "block_size", "capacity_blocks", "max_seqs", "_len")

    def __init__(self, device: Device, handle: object) -> None:
        self.device = device
        self._lib = device._lib
        self._ffi = device._ffi
        self._h = handle
        self._len = self._ffi.new("uint32_t *")
        bs, cap, free, seqs = (self._ffi.new("uint32_t *"), self._ffi.new("uint32_t *"), self._ffi.new("uint32_t *"),
                               self._ffi.new("int32_t *"))
        rc = self._lib.calrt_kv_geometry(handle, bs, cap, free, seqs)
        if rc != 0:
            raise RuntimeError(f"CalRT kv_geometry failed with code {rc}")
        self.block_size = int(bs[0])
        self.capacity_blocks = int(cap[0])
        self.max_seqs = int(seqs[0])

    @property
    def address(self) -> int:
        """The handle's address (a ``uintptr_t``), for host native code that calls the runtime
        through :meth:`CalRT.function_address` (the relay, drivers/native/relay.py)."""
        return int(self._ffi.cast("uintptr_t", self._h))

    def free_blocks(self) -> tuple[int, int]:
        bs, cap, free, seqs = (self._ffi.new("uint32_t *"), self._ffi.new("uint32_t *"), self._ffi.new("uint32_t *"),
                               self._ffi.new("int32_t *"))
        rc = self._lib.calrt_kv_geometry(self._h, bs, cap, free, seqs)
        return rc, int(free[0]) if rc == 0 else 0

    def can_allocate(self, n_blocks: int) -> bool:
        return bool(self._lib.calrt_kv_can_allocate(self._h, n_blocks))

    def apply(self, seq: int, target_len: int) -> bool:
        return bool(self._lib.calrt_kv_apply(self._h, seq, target_len))

    def seq_len(self, seq: int) -> tuple[int, int]:
        rc = self._lib.calrt_kv_seq_len(self._h, seq, self._len)
        return rc, int(self._len[0]) if rc == 0 else 0

    def release(self, seq: int) -> int:
        return self._lib.calrt_kv_release(self._h, seq)

    def destroy(self) -> int:
        return self._lib.calrt_kv_destroy(self._h)


_COUNTER_FIELDS = tuple(name for name, _ in _ffi.typeof("calrt_emu_counters").fields)


def _name(enum_type, value: int) -> str:
    try:
        return enum_type(value).name
    except ValueError:
        return str(value)


class Emulator:
    """calrt_emu_ controls of a device (latency, knobs, faults, stepped mode, counters)."""

    __slots__ = ("_lib", "_ffi", "_h", "_did", "_counters", "_fired_before")

    def __init__(self, device: Device) -> None:
        self._lib = device._lib
        self._ffi = device._ffi
        self._h = device._h
        self._did = self._ffi.new("int32_t *")
        self._counters = self._ffi.new("calrt_emu_counters *")
        self._fired_before = 0  # faults fired by arms that a later set_fault reset

    def calbin_error(self) -> str:
        """Why this thread's last calbin load was refused for a tensor dtype ("" otherwise)."""
        buf = self._ffi.new("char[]", 256)
        if self._lib.calrt_emu_calbin_error(buf, 256) != 0:
            return ""
        return self._ffi.string(buf).decode("utf-8", "replace")

    def set_latency(self, h2d_us: int = 0, prefill_per_token_us: int = 0, decode_us: int = 0, d2h_us: int = 0) -> int:
        return self._lib.calrt_emu_set_latency(self._h, h2d_us, prefill_per_token_us, decode_us, d2h_us)

    def set_knob(self, key: str, value: int) -> int:
        return self._lib.calrt_emu_set_knob(self._h, key.encode(), value)

    def get_knob(self, key: str) -> tuple[int, int]:
        val = self._ffi.new("int64_t *")
        rc = self._lib.calrt_emu_get_knob(self._h, key.encode(), val)
        return rc, int(val[0]) if rc == 0 else 0

    def set_fault(self, point: int, mode: int, param: int = 1, seed: int = 0, rc: int = 0) -> int:
        """Arm a fault point (see calrt_emu.h: NTH param=n, EVERY_K param=k, PROB param=ppm).
        Logged (``calexec.injected``, marked INJECTED) when it is armed."""
        before = self.fault_stats(point)[2]  # set resets the point's fired counter: keep it
        result = self._lib.calrt_emu_fault_set(self._h, point, mode, param, seed, rc)
        if result == 0:
            self._fired_before += before
        if result == 0 and mode != FaultMode.OFF:
            inject_log.warning("INJECTED fault armed: point=%s mode=%s param=%d seed=%d rc=%d",
                               _name(Fault, point), _name(FaultMode, mode), param, seed, rc)
        return result

    def injected_fired(self) -> int:
        """Faults the fault plan has fired through this object since it was made, every point
        summed (monotonic: a re-arm resets the point's counter, its earlier count is kept)."""
        return self._fired_before + sum(self.fault_stats(p)[2] for p in Fault if p != Fault.COUNT)

    def clear_fault(self, point: int) -> int:
        return self._lib.calrt_emu_fault_clear(self._h, point)

    def clear_all_faults(self) -> int:
        rcs = [self.clear_fault(p) for p in Fault if p != Fault.COUNT]
        return next((rc for rc in rcs if rc != 0), 0)

    def fault_stats(self, point: int) -> tuple[int, int, int]:
        """(rc, calls counted, fired) since the point was last set."""
        calls, fired = self._ffi.new("uint64_t *"), self._ffi.new("uint64_t *")
        rc = self._lib.calrt_emu_fault_stats(self._h, point, calls, fired)
        return rc, int(calls[0]), int(fired[0])

    def set_stepped(self, on: bool) -> int:
        return self._lib.calrt_emu_set_stepped(self._h, 1 if on else 0)

    def step(self, engine: int = 0, what: int = 0) -> tuple[int, int]:
        """Advance engine by one stage (what=Stage.NONE), a named stage, or a whole job."""
        rc = self._lib.calrt_emu_step(self._h, engine, what, self._did)
        return rc, self._did[0]

    def pending(self, engine: int = 0) -> tuple[int, int, int]:
        """(rc, jobs queued or running, next stage of the head job)."""
        jobs, stage = self._ffi.new("int32_t *"), self._ffi.new("int32_t *")
        rc = self._lib.calrt_emu_pending(self._h, engine, jobs, stage)
        return rc, int(jobs[0]), int(stage[0])

    def counters(self) -> dict[str, int]:
        """Counter name -> value; empty dict if the device handle is stale."""
        if self._lib.calrt_emu_get_counters(self._h, self._counters) != 0:
            return {}
        return {name: int(getattr(self._counters, name)) for name in _COUNTER_FIELDS}


def emulator_of(device: object) -> Emulator | None:
    """The bundled emulator's controls of ``device`` (an executor's ``device``, typed
    ``DeviceApi | None`` there), or None: no device is open, or it is a vendor shim's. A
    proxy that forwards ``emu`` (the interleaving explorer's) answers its device's."""
    emu = getattr(device, "emu", None)
    return emu if isinstance(emu, Emulator) else None


def bundled_emulator(device: object) -> Emulator:
    """``emulator_of(device)`` for a tool that needs the emulator's controls: a TypeError
    naming the device when it has none (a vendor runtime, or no device open)."""
    emu = emulator_of(device)
    if emu is None:
        raise TypeError(f"device={device!r:.200}: not a device of the bundled emulator (no "
                        "emulator controls: a vendor runtime, or no device open)")
    return emu


class NativeSubmitRelay:
    """The executor's submitter wait in C (machines/device_api.py ``SubmitRelay``) over a
    submitter-only :class:`NativeRelay`: the handles a job is given to ``infer`` with are
    passed by address (``.address`` of this driver's objects)."""

    __slots__ = ("_relay", "_closed")

    def __init__(self, relay: NativeRelay) -> None:
        self._relay = relay
        self._closed = False

    def fire(self, tag: int, device: Device, model: Model, kv: KvManager, seq: int,
             inbuf: InputBuf, outbuf: OutputBuf, /) -> bool:
        return self._relay.fire(RelayJob(tag=tag, dev=device.address, model=model.address,
                                         kv=kv.address, inbuf=inbuf.address,
                                         outbuf=outbuf.address, seq=seq)) == 0

    def wake(self) -> None:
        self._relay.wake()

    def wait(self, timeout_s: float, /) -> tuple[int, int, int]:
        event = self._relay.submitter_wait(timeout_s)
        if not isinstance(event, RelayEvent):  # a code: EBUSY (a second submitter), ENULL
            raise RuntimeError(f"calexec_relay_submitter_wait refused: {event!r}")
        if event.kind == Kind.INFERRED:
            return int(Kind.INFERRED), event.tag, event.rc
        return int(event.kind), 0, 0

    def close(self) -> list[int]:
        self._closed = True
        return self._relay.close()

    def free(self) -> None:
        if self._closed:
            self._relay.free()
