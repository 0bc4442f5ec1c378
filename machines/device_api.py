"""What machines/ calls on the runtime, as typed protocols (issue 25, "typed seams").

The control core never imports the driver: it receives a runtime object and everything made
from it (device, calbin, model, KvManager, input and output buffers), duck-typed.
``calexec.drivers.calrt.runtime`` (``CalRT``, ``Device``, ``Calbin``, ``Model``, ``KvManager``,
``InputBuf``, ``OutputBuf``) satisfies these protocols structurally, and so do the interleaving
explorer's proxies (drivers/tools/explore.py); mypy checks it where a driver hands one to the
core (``DeviceSpec.runtime``, ``Explorer.runtime``). Each protocol lists exactly the members
machines/ uses, with the driver's contract: a raw CalRT code (``int``, 0 success) or a tuple
whose first item is that code, never an exception for a runtime failure; an object returned
beside a code is None unless the code is 0.

Handles that machines/ passes back to the runtime that made them (the calbin to
``configure``/``create_kv``; the model, KvManager and buffers to ``infer``) are typed ``Any`` in
those parameters: a protocol's parameters are contravariant, and each runtime accepts only its
own handle classes there (the cffi driver's ``Device.infer`` takes its ``Model``, not any
``ModelApi``). What machines/ does with the handles themselves is typed by the protocols.

Optional members, probed with ``getattr`` (a vendor runtime may lack them):
``RuntimeApi.logits_postprocessor()`` -> ``LogitsPostprocessor`` (else the numpy path),
``RuntimeApi.submit_relay(clock)`` -> ``SubmitRelay | None`` (the submitter's wait and the
infer of a fired job in native code, with ``ExecutorConfig.native_relay``; else Python's),
``DeviceApi.dma_quiescent()`` -> ``bool | None`` (proof that no stale DMA is pending),
``DeviceApi.injected_faults_fired()`` -> ``int | None`` (the emulator's fault plan),
``KvManagerApi.capacity_blocks`` and ``max_seqs`` (``int``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, Unpack

import numpy as np

from calexec.contracts.runtime_view import RuntimeModelInfo
from calexec.contracts.status import Phase, Status, StatusContext


def no_object(what: str, phase: Phase, **ctx: Unpack[StatusContext]) -> Status:
    """A runtime call answered 0 without the object it makes: the runtime broke the driver
    contract (INTERNAL: the generation is not trusted)."""
    return Status.internal("runtime_no_object", phase, f"{what} returned 0 but no object", **ctx)


class InputBufApi(Protocol):
    """An InputBuf of one model (CalRT MapBuf/SliceTensor/UndoSlice/SetCsr)."""

    def map(self, tensor: str, arr: np.ndarray, /) -> int:
        """Map host storage (never copied: it must outlive the mapping)."""
        ...

    def slice(self, tensor: str, offset_elems: int, count_elems: int, /) -> int: ...

    def undo_slice(self, tensor: str, /) -> int: ...

    def set_csr(self, name: str, value: int, /) -> int: ...

    def destroy(self) -> int: ...


class OutputBufApi(Protocol):
    """An OutputBuf of one model: the device writes the mapped array at D2H."""

    def map(self, tensor: str, arr: np.ndarray, /) -> int: ...

    def wait(self, timeout_us: int, /) -> int:
        """Block until the job on this buffer ends (0) or ``timeout_us`` passes (13)."""
        ...

    def get_status(self) -> tuple[int, int]:
        """(rc, job status: calexec.contracts.codes.DeviceJobStatus)."""
        ...

    def valid_bytes(self) -> tuple[int, int]: ...

    def copy_ms(self) -> tuple[float, float] | None:
        """(H2D, D2H) copy times of the last job in ms, or None when the runtime cannot say."""
        ...

    def destroy(self) -> int: ...


class ModelApi(Protocol):
    """One graph of a calbin."""

    @property
    def info(self) -> RuntimeModelInfo:
        """What the runtime reports about the graph (``GetAllModels``); RuntimeError when it
        cannot be read (the runtime refuses it, or a name is not UTF-8)."""
        ...

    def create_input_buf(self) -> tuple[int, InputBufApi | None]: ...

    def create_output_buf(self) -> tuple[int, OutputBufApi | None]: ...


class CalbinApi(Protocol):
    """A loaded calbin; ``sha256`` of its bytes names the generation."""

    @property
    def sha256(self) -> str: ...

    def models(self) -> tuple[int, Sequence[ModelApi]]: ...

    def unload(self) -> int: ...


class KvManagerApi(Protocol):
    """The device's KvManager (0.7.6: ``can_allocate``/``apply`` answer a bool, no reason)."""

    @property
    def block_size(self) -> int: ...

    def can_allocate(self, n_blocks: int, /) -> bool: ...

    def apply(self, seq: int, target_len: int, /) -> bool: ...

    def release(self, seq: int, /) -> int: ...

    def destroy(self) -> int: ...


class DeviceApi(Protocol):
    """One opened device. The ``Any`` parameters are handles this device made (module
    docstring)."""

    def load_calbin(self, path: str, /) -> tuple[int, CalbinApi | None]: ...

    def configure(self, calbin: Any, /) -> int: ...

    def create_kv(self, calbin: Any, /) -> tuple[int, KvManagerApi | None]: ...

    def enable_parallel_mode(self, on: bool, /) -> int: ...

    def infer(self, model: Any, kv: Any, seq: int, inbuf: Any, outbuf: Any, /) -> int: ...

    def infer_with_fixed_task_type(self, model: Any, kv: Any, seq: int, inbuf: Any,
                                   outbuf: Any, task: int, /) -> int: ...

    def reset(self) -> int: ...

    def reset_ccu(self) -> int: ...

    def reset_configuration(self) -> int: ...

    def close(self) -> int: ...


class RuntimeApi(Protocol):
    """A loaded CalRT library: what ``DeviceExecutor`` is given."""

    def open_device(self, config: str = "", /) -> tuple[int, DeviceApi | None]: ...


class LogitsPostprocessor(Protocol):
    """The fused native logits postprocess (drivers/native/fused_logits.py ``FusedLogits``):
    BF16 slice -> FP32 into ``dst``, finiteness and argmax in one pass."""

    #: the rc of a slice holding NaN/Inf (``first_nonfinite`` says where)
    NONFINITE: int
    #: rc -> what it means, for messages
    RC_NAMES: Mapping[int, str]

    def __call__(self, src: np.ndarray, base: int, n: int, dst: np.ndarray, /) -> int: ...

    def check(self, src: np.ndarray, base: int, n: int, dst: np.ndarray, /) -> int:
        """``__call__`` without writing ``dst``: the same rc, argmax and first_nonfinite."""
        ...

    @property
    def argmax(self) -> int:
        """This thread's last call: index within the slice of the first maximum."""
        ...

    @property
    def first_nonfinite(self) -> int: ...


#: the kinds of ``SubmitRelay.wait``'s answer (drivers/native/calexec_relay.h's event kinds)
RELAY_TIMEOUT, RELAY_INFERRED, RELAY_WAKE, RELAY_CLOSED = 0, 1, 2, 3


class SubmitRelay(Protocol):
    """The submitter's idle wait, in native code (issue 28; docs/architecture.md, "Native
    hand-offs"). A thread that queues a job the submitter would submit next at once hands it
    to ``fire``; the submitter thread, blocked in ``wait`` with the GIL released, calls
    ``device.infer`` on it right away, without a Python wake-up in between, and then reports
    it (INFERRED) for the submitter's Python to apply what follows infer. Only the thread in
    ``wait`` calls infer (invariant 2). ``wake`` ends a wait that Python has work for
    (coalesced); ``close`` ends every wait from then on and returns the tags of the jobs
    fired and never given to infer. A runtime offers one through ``submit_relay(clock)``,
    only for a clock its waits follow (the native relay waits in real time)."""

    def fire(self, tag: int, device: Any, model: Any, kv: Any, seq: int, inbuf: Any,
             outbuf: Any, /) -> bool:
        """Queue a job for the submitter's ``infer`` (False: closed or full; not queued)."""
        ...

    def wake(self) -> None: ...

    def wait(self, timeout_s: float, /) -> tuple[int, int, int]:
        """(kind, tag, rc): RELAY_INFERRED with the job's tag and infer's code, RELAY_WAKE,
        RELAY_CLOSED or RELAY_TIMEOUT (tag and rc 0)."""
        ...

    def close(self) -> list[int]: ...

    def free(self) -> None:
        """Only after ``close`` and once no thread is in ``wait``."""
        ...
