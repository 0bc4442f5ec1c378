"""``Status``: every failure as a value (spec §6, §8), and the llama_decode compatibility code.

A Status carries a short stable ``code`` (``"<domain>.<reason>"``, for metrics and tests), the
§8 ``category``, the ``phase`` where it happened, the raw CalRT code when a runtime call failed,
a ``message`` naming the bad field and value, and the job context (job id, seq id,
generation) that §6.1 requires every log line to keep. ``Status.OK`` is the one success.

llama.cpp compatibility (§6.1): :func:`llama_decode_code` maps a Status onto ``llama_decode``'s
return convention:

====  ===================================================  =======================================
code  llama.cpp meaning                                    Status
====  ===================================================  =======================================
 0    success                                              ``ok``
 1    could not find a KV slot (caller may retry smaller)  category RESOURCE_EXHAUSTED
 2    aborted                                              category CANCELLED or DEADLINE
-1    invalid input batch                                  category INVALID_REQUEST
-2    other error (llama.cpp: "< -1 fatal")                every other category (device, artifact,
                                                           lifecycle, transient, internal, ...)
====  ===================================================  =======================================
"""

from __future__ import annotations

import enum
import re
from typing import ClassVar, SupportsInt, TypedDict, Unpack

import attrs

from calexec.contracts.codes import CalrtCode, DeviceJobStatus, describe
from calexec.contracts.errors import SERVICE_OK, Category, classify, service_mapping


class Phase(enum.Enum):
    """Where in a job's or the device's life a Status was produced."""

    VALIDATE = "validate"
    LOOKUP = "lookup"
    ADMISSION = "admission"
    LEASE = "lease"
    PREPARE = "prepare"
    CSR = "csr"
    MAP = "map"
    SLICE = "slice"
    SUBMIT = "submit"
    WAIT = "wait"
    STATUS = "status"
    OUTPUT_CHECK = "output_check"
    POSTPROCESS = "postprocess"
    COMMIT = "commit"
    RELEASE = "release"
    CANCEL = "cancel"
    SHUTDOWN = "shutdown"
    RECOVERY = "recovery"
    CONFIGURE = "configure"
    GOLDEN = "golden"


_CODE_RE = re.compile(r"\A[a-z0-9_]+(\.[a-z0-9_]+)+\Z")


def _check_code(instance: object, attribute: attrs.Attribute[str], value: str) -> None:
    if value != "ok" and not _CODE_RE.fullmatch(value):
        raise ValueError(f"Status.code={value!r}: must be 'ok' or '<domain>.<reason>' in [a-z0-9_]")


class StatusIds(TypedDict, total=False):
    """The job context a Status carries, as a constructor's keywords (``**ctx``): each an
    int (or anything ``int()`` takes: a numpy integer, an IntEnum) or None."""

    job_id: SupportsInt | None
    seq_id: SupportsInt | None
    generation: SupportsInt | None


class StatusStepIds(StatusIds, total=False):
    """``StatusIds`` and the §6.3 step (the constructors that set the step take only ids)."""

    step: SupportsInt | None


class StatusContext(StatusStepIds, total=False):
    """Every context keyword of ``Status.failure`` (``from_calrt`` sets ``raw`` itself)."""

    raw: SupportsInt | None  #: the raw CalRT code


class StatusDict(TypedDict):
    """``Status.to_dict()``: JSON-ready, the same keys for every Status."""

    ok: bool
    code: str
    category: str | None
    phase: str | None
    raw: int | None
    raw_name: str | None
    message: str
    job_id: int | None
    seq_id: int | None
    generation: int | None
    step: int | None
    http_status: int
    grpc_code: str


def _optional_int(value: SupportsInt | None) -> int | None:
    return None if value is None else int(value)


@attrs.frozen
class Status:
    """Result of an operation. ``ok`` iff ``code == "ok"``; then category/phase are None.

    Construct failures with the named constructors; ``with_context`` adds job context later.
    """

    code: str = attrs.field(validator=_check_code)
    category: Category | None = None
    phase: Phase | None = None
    raw: int | None = attrs.field(default=None, converter=_optional_int)  # raw CalRT code
    message: str = ""
    job_id: int | None = attrs.field(default=None, converter=_optional_int)
    seq_id: int | None = attrs.field(default=None, converter=_optional_int)
    generation: int | None = attrs.field(default=None, converter=_optional_int)
    step: int | None = attrs.field(default=None, converter=_optional_int)  # §6.3 step, if any

    OK: ClassVar[Status]

    def __attrs_post_init__(self) -> None:
        if (self.code == "ok") != (self.category is None):
            raise ValueError(
                f"Status.code={self.code!r} with category={self.category}: "
                "'ok' has no category and every failure has one"
            )

    @property
    def ok(self) -> bool:
        return self.code == "ok"

    @property
    def http_status(self) -> int:
        # a failure always has a category, OK never (__attrs_post_init__)
        if self.category is None:
            return SERVICE_OK.http_status
        return service_mapping(self.category).http_status

    @property
    def grpc_code(self) -> str:
        if self.category is None:
            return SERVICE_OK.grpc_code
        return service_mapping(self.category).grpc_code

    # ---- constructors -------------------------------------------------------------------
    @classmethod
    def failure(cls, code: str, category: Category, phase: Phase, message: str, **ctx: Unpack[StatusContext]) -> Status:
        """A failure with an explicit code and category; ``ctx``: raw, job_id, seq_id, generation, step."""
        return cls(code=code, category=category, phase=phase, message=message, **ctx)

    @classmethod
    def from_calrt(cls, raw: int, phase: Phase, message: str = "", **ctx: Unpack[StatusStepIds]) -> Status:
        """Status of a CalRT call that returned ``raw``: ``OK`` for 0, else classified by §8.

        code is ``calrt.<phase>_failed``; the message always names the raw code.
        """
        if raw == CalrtCode.SUCCESS:
            return cls.OK
        rule = classify(raw)
        text = f"CalRT {phase.value} returned {describe(raw)}"
        return cls.failure(
            f"calrt.{phase.value}_failed", rule.category, phase,
            f"{text}: {message}" if message else text, raw=raw, **ctx,
        )

    @classmethod
    def from_csr(cls, raw: int, csr_name: str, value: int, **ctx: Unpack[StatusIds]) -> Status:
        """§6.3 step 7: ``SetCsrByName(csr_name, value)`` returned ``raw`` (OK for 0)."""
        return cls.from_calrt(raw, Phase.CSR, f"SetCsrByName({csr_name!r}, {value})", step=7, **ctx)

    @classmethod
    def from_map(cls, raw: int, tensor: str, **ctx: Unpack[StatusIds]) -> Status:
        """§6.3 step 8: ``MapBuf`` of ``tensor`` returned ``raw`` (OK for 0)."""
        return cls.from_calrt(raw, Phase.MAP, f"MapBuf(tensor={tensor!r})", step=8, **ctx)

    @classmethod
    def from_slice(cls, raw: int, tensor: str, offset: int, size: int, **ctx: Unpack[StatusIds]) -> Status:
        """§6.3 step 8: ``SliceTensor(tensor, offset, size)`` returned ``raw`` (OK for 0)."""
        return cls.from_calrt(
            raw, Phase.SLICE, f"SliceTensor(tensor={tensor!r}, offset={offset}, size={size})", step=8, **ctx
        )

    @classmethod
    def from_device_status(cls, device_status: int, **ctx: Unpack[StatusContext]) -> Status:
        """``GetStatus()`` after a successful ``Wait()``: OK only for DONE.

        DONE_CCU_EXCEPTION is a DEVICE failure (FI08); any other value means the job had not
        finished although Wait() said so, which is treated as UNKNOWN (§8 last row). That
        includes ABORTED when nothing says who reset the device; a job the executor's own
        reset aborted is told by :meth:`aborted_by_reset` instead (the completion side knows).
        """
        if device_status == DeviceJobStatus.DONE:
            return cls.OK
        if device_status == DeviceJobStatus.DONE_CCU_EXCEPTION:
            return cls.failure("device.ccu_exception", Category.DEVICE, Phase.STATUS,
                               "GetStatus()=DONE_CCU_EXCEPTION after Wait()", **ctx)
        try:
            name = DeviceJobStatus(device_status).name
        except ValueError:
            name = "not a device job status"
        return cls.failure("device.status_not_done", Category.UNKNOWN, Phase.STATUS,
                           f"GetStatus()={device_status} ({name}) after a successful Wait()", **ctx)

    @classmethod
    def aborted_by_reset(cls, reset: str, **ctx: Unpack[StatusContext]) -> Status:
        """``GetStatus()=ABORTED`` for a job that was on the device when the executor itself
        reset it (``reset``: the reset it asked for, e.g. ``"reset"``; a recovery's drain
        grace ran out, or a refused generation was torn down): a knock-on of that recovery,
        not an unknown outcome (its output was never written): ``recovery.job_aborted``,
        UNAVAILABLE (503, retry once the device is Ready again)."""
        return cls.failure("recovery.job_aborted", Category.UNAVAILABLE, Phase.STATUS,
                           f"GetStatus()=ABORTED after Wait(): the executor's own device {reset} "
                           "(a recovery, or a refused generation torn down) aborted the job "
                           "before it finished; its output was not written; retry", **ctx)

    @classmethod
    def invalid(cls, step: int, message: str, **ctx: Unpack[StatusIds]) -> Status:
        """§6.3 validation failure at ``step`` (1-6), before any runtime call: 400."""
        return cls.failure("request.invalid", Category.INVALID_REQUEST, Phase.VALIDATE,
                           f"step {step}: {message}", step=step, **ctx)

    @classmethod
    def cancelled(cls, phase: Phase, message: str = "cancel requested", **ctx: Unpack[StatusContext]) -> Status:
        return cls.failure("request.cancelled", Category.CANCELLED, phase, message, **ctx)

    @classmethod
    def deadline(cls, phase: Phase, message: str = "deadline passed", **ctx: Unpack[StatusContext]) -> Status:
        """A §9.1 deadline passed; code ``<phase>.deadline`` tells which (admission/queue/wait)."""
        return cls.failure(f"{phase.value}.deadline", Category.DEADLINE, phase, message, **ctx)

    @classmethod
    def exhausted(cls, resource: str, phase: Phase, message: str, **ctx: Unpack[StatusContext]) -> Status:
        """``resource`` (``"kv"``, ``"queue"``, ...) is full: code ``<resource>.full``, 429."""
        return cls.failure(f"{resource}.full", Category.RESOURCE_EXHAUSTED, phase, message, **ctx)

    @classmethod
    def unavailable(cls, phase: Phase, message: str, **ctx: Unpack[StatusContext]) -> Status:
        """The device lifecycle is not Ready (draining, recovering, failed, shut down): 503."""
        return cls.failure("lifecycle.unavailable", Category.UNAVAILABLE, phase, message, **ctx)

    @classmethod
    def internal(cls, reason: str, phase: Phase, message: str, **ctx: Unpack[StatusContext]) -> Status:
        """Executor-detected fault (``internal.<reason>``), e.g. non-finite or short output: 500."""
        return cls.failure(f"internal.{reason}", Category.INTERNAL, phase, message, **ctx)

    @classmethod
    def artifact(cls, reason: str, message: str, **ctx: Unpack[StatusContext]) -> Status:
        """The manifest and the runtime's models disagree (``manifest.<reason>``): refuse the generation."""
        return cls.failure(f"manifest.{reason}", Category.ARTIFACT, Phase.CONFIGURE, message, **ctx)

    # ---- context and output -------------------------------------------------------------
    def with_context(self, *, job_id: int | None = None, seq_id: int | None = None,
                     generation: int | None = None) -> Status:
        """A copy with the given context fields set (fields passed as None are kept)."""
        changes: StatusIds = {}
        if job_id is not None:
            changes["job_id"] = job_id
        if seq_id is not None:
            changes["seq_id"] = seq_id
        if generation is not None:
            changes["generation"] = generation
        return attrs.evolve(self, **changes) if changes else self

    def to_dict(self) -> StatusDict:
        """A JSON-ready dict with a fixed key set, for structured logs and HTTP bodies."""
        return {
            "ok": self.ok,
            "code": self.code,
            "category": None if self.category is None else self.category.value,
            "phase": None if self.phase is None else self.phase.value,
            "raw": self.raw,
            "raw_name": None if self.raw is None else describe(self.raw),
            "message": self.message,
            "job_id": self.job_id,
            "seq_id": self.seq_id,
            "generation": self.generation,
            "step": self.step,
            "http_status": self.http_status,
            "grpc_code": self.grpc_code,
        }

    def __str__(self) -> str:
        if self.category is None:  # ok
            return "ok"
        # the raw CalRT code too (§6.1: a log line names job, sequence, generation, raw code
        # and phase): a message need not spell it out (an execution deadline's keeps Wait's)
        ctx = " ".join(f"{k}={getattr(self, k)}" for k in ("job_id", "seq_id", "generation", "raw")
                       if getattr(self, k) is not None)
        phase = None if self.phase is None else self.phase.value
        return (f"{self.code} [{self.category.value}/{phase}] {self.message}"
                + (f" ({ctx})" if ctx else ""))


Status.OK = Status(code="ok")

_LLAMA_CODES: dict[Category, int] = {
    Category.RESOURCE_EXHAUSTED: 1,
    Category.CANCELLED: 2,
    Category.DEADLINE: 2,
    Category.INVALID_REQUEST: -1,
}


def llama_decode_code(status: Status) -> int:
    """``llama_decode``-style int for the synchronous entry (§6.1); table in the module docstring.

    The caller must still log ``status`` in full: the int loses the job context and raw code.
    """
    if status.category is None:  # ok
        return 0
    return _LLAMA_CODES.get(status.category, -2)
