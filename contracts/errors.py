"""Spec §8 as data: CalRT code -> category -> actions, and category -> gRPC/HTTP.

Every row of the §8 table is one :class:`ErrorRule`; :func:`classify` returns the row of a
raw CalRT code. Codes the table does not list (0 excepted: success is not an error) fall to
the Unknown row: 3, 6, 26, anything above 29 and anything negative.

==================  ==================  ============  ===================  ==========================
codes               category            current job   new admission        automatic action
==================  ==================  ============  ===================  ==========================
1 14 21 22          REQUEST_ARTIFACT    FAIL          CONTINUE_OR_ISOLATE  RECORD_MANIFEST_DIFF
2 7 16              LIFECYCLE           FAIL          PAUSE                DRAIN_CHECK_GENERATION
4 5 19 10 11 12     ARTIFACT            FAIL          REFUSE_GENERATION    ROLLBACK_LAST_GOOD
8 9 23              COMPATIBILITY       FAIL          STOP                 MANUAL_FIX
13 17               TRANSIENT           RETRY_QUEUED  REDUCE               BOUNDED_BACKOFF_THEN_DRAIN
18 24 25 28         DEVICE              FAIL          STOP_NOW             QUARANTINE_RESET_ESCALATE
27 29               PROGRAMMING         FAIL          DISABLE_FEATURE      FIX_CODE_NO_RESET
15 20, all others   UNKNOWN             FAIL          PAUSE                TREAT_GENERATION_TAINTED
==================  ==================  ============  ===================  ==========================

Service mapping, one per category (:func:`service_mapping`). §8's last paragraph fixes five of
them; the rest are decided here and the reason given:

==================  ==================  ====  ===========================================================
category            gRPC                HTTP  why
==================  ==================  ====  ===========================================================
INVALID_REQUEST     INVALID_ARGUMENT    400   §8 "input out of bounds": refused before any runtime call
RESOURCE_EXHAUSTED  RESOURCE_EXHAUSTED  429   §8 "KV/queue full"
DEADLINE            DEADLINE_EXCEEDED   504   §8 "deadline"
CANCELLED           CANCELLED           499   the caller cancelled; 499 is nginx's "client closed request"
UNAVAILABLE         UNAVAILABLE         503   §8 "device recovering": lifecycle not Ready, retry later
DEVICE              UNAVAILABLE         503   admission stops and recovery starts: retry later
LIFECYCLE           UNAVAILABLE         503   admission paused while the generation/config is checked
TRANSIENT           UNAVAILABLE         503   timeout/busy; UNAVAILABLE is gRPC's retryable code
REQUEST_ARTIFACT    INTERNAL            500   §8 "internal shape errors": the request already passed the
                                              manifest checks, so a runtime bound/dtype/shape failure is a
                                              manifest/artifact discrepancy, not the client's fault
ARTIFACT            INTERNAL            500   §8 "calbin errors"; the generation is refused
COMPATIBILITY       INTERNAL            500   needs a manual fix; retrying cannot help
PROGRAMMING         INTERNAL            500   a calexec bug or configuration error
INTERNAL            INTERNAL            500   executor-side invariant violations (e.g. bad output)
UNKNOWN             UNKNOWN             500   gRPC's own code for an unclassified failure
==================  ==================  ====  ===========================================================
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

import attrs

from calexec.contracts.codes import CalrtCode


class Category(enum.Enum):
    """What kind of failure: the §8 rows, then the executor's own (non-CalRT) categories."""

    REQUEST_ARTIFACT = "request_artifact"
    LIFECYCLE = "lifecycle"
    ARTIFACT = "artifact"
    COMPATIBILITY = "compatibility"
    TRANSIENT = "transient"
    DEVICE = "device"
    PROGRAMMING = "programming"
    UNKNOWN = "unknown"
    # Not produced by CalRT codes:
    CANCELLED = "cancelled"  # the caller cancelled (§9, trio semantics: the result says so)
    DEADLINE = "deadline"  # one of the §9.1 deadlines passed
    RESOURCE_EXHAUSTED = "resource_exhausted"  # KV capacity or queue full
    INVALID_REQUEST = "invalid_request"  # rejected by validation before any runtime call (§6.3)
    UNAVAILABLE = "unavailable"  # lifecycle not Ready (Draining/Recovering/Failed)
    INTERNAL = "internal"  # executor-detected fault, e.g. non-finite or short output


class JobAction(enum.Enum):
    """§8 column "current job"."""

    FAIL = "fail"
    # "fail, or queue again before a retry": a bounded re-queue is allowed only when the
    # runtime certainly did not execute the graph (e.g. infer() returned DEVICE_BUSY);
    # after a successful submit the job fails and its KV is Unknown (§7).
    RETRY_QUEUED = "retry_queued"


class AdmissionAction(enum.Enum):
    """§8 column "new admission"."""

    CONTINUE_OR_ISOLATE = "continue_or_isolate"  # same model may continue, or isolate the artifact
    PAUSE = "pause"
    REFUSE_GENERATION = "refuse_generation"
    STOP = "stop"
    REDUCE = "reduce"
    STOP_NOW = "stop_now"
    DISABLE_FEATURE = "disable_feature"


class AutoAction(enum.Enum):
    """§8 column "automatic action"."""

    RECORD_MANIFEST_DIFF = "record_manifest_diff"  # record the manifest difference; no reset
    DRAIN_CHECK_GENERATION = "drain_check_generation"  # drain, check generation/config
    ROLLBACK_LAST_GOOD = "rollback_last_good"  # roll back to the last known-good model
    MANUAL_FIX = "manual_fix"  # manual repair, never retried automatically
    BOUNDED_BACKOFF_THEN_DRAIN = "bounded_backoff_then_drain"  # drain when a threshold is hit
    QUARANTINE_RESET_ESCALATE = "quarantine_reset_escalate"  # quarantine -> reset/restart/escalate
    FIX_CODE_NO_RESET = "fix_code_no_reset"  # no reset; fix code/configuration
    TREAT_GENERATION_TAINTED = "treat_generation_tainted"  # conservatively: device generation tainted


def _int_set(codes: Iterable[int]) -> frozenset[int]:
    return frozenset(codes)


@attrs.frozen
class ErrorRule:
    """One row of the §8 table."""

    codes: frozenset[int] = attrs.field(converter=_int_set)
    category: Category
    job_action: JobAction
    admission_action: AdmissionAction
    auto_action: AutoAction


def _row(codes: tuple[int, ...], category: Category, job: JobAction, admission: AdmissionAction,
         auto: AutoAction) -> ErrorRule:
    return ErrorRule(frozenset(int(c) for c in codes), category, job, admission, auto)


C = CalrtCode
UNKNOWN_RULE = _row(
    (C.UNEXPECTED, C.UNKNOWN), Category.UNKNOWN, JobAction.FAIL, AdmissionAction.PAUSE,
    AutoAction.TREAT_GENERATION_TAINTED,
)
#: The §8 table, in the spec's row order.
RULES: tuple[ErrorRule, ...] = (
    _row((C.MEM_ALLOC, C.OUT_OF_BOUNDS, C.DTYPE_MISMATCH, C.SHAPE_MISMATCH), Category.REQUEST_ARTIFACT,
         JobAction.FAIL, AdmissionAction.CONTINUE_OR_ISOLATE, AutoAction.RECORD_MANIFEST_DIFF),
    _row((C.ALREADY_REGISTERED, C.ALREADY_CONFIGURED, C.MISSING_CONFIG), Category.LIFECYCLE,
         JobAction.FAIL, AdmissionAction.PAUSE, AutoAction.DRAIN_CHECK_GENERATION),
    _row((C.INVALID_VALUE, C.INVALID_CONFIG, C.INVALID_CALBIN, C.FILE_NOT_FOUND, C.FILE_READ,
          C.FILE_FORMAT), Category.ARTIFACT,
         JobAction.FAIL, AdmissionAction.REFUSE_GENERATION, AutoAction.ROLLBACK_LAST_GOOD),
    _row((C.DRIVER_INCOMPATIBLE, C.RUNTIME_TOO_OLD, C.DEPENDENCY), Category.COMPATIBILITY,
         JobAction.FAIL, AdmissionAction.STOP, AutoAction.MANUAL_FIX),
    _row((C.TIMEOUT, C.DEVICE_BUSY), Category.TRANSIENT,
         JobAction.RETRY_QUEUED, AdmissionAction.REDUCE, AutoAction.BOUNDED_BACKOFF_THEN_DRAIN),
    _row((C.DEVICE_UNAVAILABLE, C.MAP_BROKEN, C.SOFT_RESET_FAILED, C.DEVICE_CRASH), Category.DEVICE,
         JobAction.FAIL, AdmissionAction.STOP_NOW, AutoAction.QUARANTINE_RESET_ESCALATE),
    _row((C.UNSUPPORTED, C.WRONG_DIRECTION), Category.PROGRAMMING,
         JobAction.FAIL, AdmissionAction.DISABLE_FEATURE, AutoAction.FIX_CODE_NO_RESET),
    UNKNOWN_RULE,
)
del C

_BY_CODE: dict[int, ErrorRule] = {code: rule for rule in RULES for code in rule.codes}


def classify(raw_code: int) -> ErrorRule:
    """The §8 row for a failed CalRT call's raw return code.

    Any code the table does not list (3, 6, 26, > 29, negative) gets the Unknown row.
    Raises ``ValueError`` for 0: success is not a failure, and classifying it is a caller bug
    (``Status.from_calrt(0, ...)`` returns ``Status.OK`` instead).
    """
    if raw_code == CalrtCode.SUCCESS:
        raise ValueError("classify: raw_code=0 is CalrtSuccess, not a failure")
    return _BY_CODE.get(int(raw_code), UNKNOWN_RULE)


@attrs.frozen
class ServiceMapping:
    """How a failure category is reported to a client."""

    grpc_code: str  # grpc.StatusCode name
    http_status: int


_SERVICE: dict[Category, ServiceMapping] = {
    Category.INVALID_REQUEST: ServiceMapping("INVALID_ARGUMENT", 400),
    Category.RESOURCE_EXHAUSTED: ServiceMapping("RESOURCE_EXHAUSTED", 429),
    Category.DEADLINE: ServiceMapping("DEADLINE_EXCEEDED", 504),
    Category.CANCELLED: ServiceMapping("CANCELLED", 499),
    Category.UNAVAILABLE: ServiceMapping("UNAVAILABLE", 503),
    Category.DEVICE: ServiceMapping("UNAVAILABLE", 503),
    Category.LIFECYCLE: ServiceMapping("UNAVAILABLE", 503),
    Category.TRANSIENT: ServiceMapping("UNAVAILABLE", 503),
    Category.REQUEST_ARTIFACT: ServiceMapping("INTERNAL", 500),
    Category.ARTIFACT: ServiceMapping("INTERNAL", 500),
    Category.COMPATIBILITY: ServiceMapping("INTERNAL", 500),
    Category.PROGRAMMING: ServiceMapping("INTERNAL", 500),
    Category.INTERNAL: ServiceMapping("INTERNAL", 500),
    Category.UNKNOWN: ServiceMapping("UNKNOWN", 500),
}

#: Mapping of a successful result.
SERVICE_OK = ServiceMapping("OK", 200)


def service_mapping(category: Category) -> ServiceMapping:
    """gRPC code name and HTTP status for a failure category (table in the module docstring)."""
    return _SERVICE[category]
