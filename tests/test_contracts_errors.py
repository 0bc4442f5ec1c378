"""Spec §8 table, row by row, and the category -> gRPC/HTTP mapping."""

import pytest

from calexec.contracts.codes import CalrtCode, DeviceJobStatus, describe
from calexec.contracts.errors import (
    RULES,
    Category,
    classify,
    service_mapping,
)
from calexec.contracts.errors import (
    AdmissionAction as A,
)
from calexec.contracts.errors import (
    AutoAction as X,
)
from calexec.contracts.errors import (
    JobAction as J,
)

# Written out from the spec's §8 table (not derived from the module under test).
SPEC_ROWS = [
    ((1, 14, 21, 22), Category.REQUEST_ARTIFACT, J.FAIL, A.CONTINUE_OR_ISOLATE, X.RECORD_MANIFEST_DIFF),
    ((2, 7, 16), Category.LIFECYCLE, J.FAIL, A.PAUSE, X.DRAIN_CHECK_GENERATION),
    ((4, 5, 19, 10, 11, 12), Category.ARTIFACT, J.FAIL, A.REFUSE_GENERATION, X.ROLLBACK_LAST_GOOD),
    ((8, 9, 23), Category.COMPATIBILITY, J.FAIL, A.STOP, X.MANUAL_FIX),
    ((13, 17), Category.TRANSIENT, J.RETRY_QUEUED, A.REDUCE, X.BOUNDED_BACKOFF_THEN_DRAIN),
    ((18, 24, 25, 28), Category.DEVICE, J.FAIL, A.STOP_NOW, X.QUARANTINE_RESET_ESCALATE),
    ((27, 29), Category.PROGRAMMING, J.FAIL, A.DISABLE_FEATURE, X.FIX_CODE_NO_RESET),
    ((15, 20), Category.UNKNOWN, J.FAIL, A.PAUSE, X.TREAT_GENERATION_TAINTED),
]
CASES = [(code, *row[1:]) for row in SPEC_ROWS for code in row[0]]


@pytest.mark.parametrize(("code", "category", "job", "admission", "auto"), CASES)
def test_every_listed_code_gets_its_row(code, category, job, admission, auto):
    rule = classify(code)
    assert (rule.category, rule.job_action, rule.admission_action, rule.auto_action) == (
        category, job, admission, auto)
    assert code in rule.codes


@pytest.mark.parametrize("code", [3, 6, 26, 30, 31, 255, -1, -13, 2**31])
def test_codes_outside_the_table_are_unknown(code):
    rule = classify(code)
    assert rule.category is Category.UNKNOWN
    assert rule.admission_action is A.PAUSE and rule.auto_action is X.TREAT_GENERATION_TAINTED


def test_success_is_not_classified():
    with pytest.raises(ValueError, match="raw_code=0"):
        classify(0)


def test_rules_partition_the_failure_codes():
    listed = [c for rule in RULES for c in rule.codes]
    assert len(listed) == len(set(listed))
    assert set(listed) == {int(c) for c in CalrtCode if c != CalrtCode.SUCCESS}
    assert [rule.category for rule in RULES] == [row[1] for row in SPEC_ROWS]


def test_code_numbers_match_the_spec():
    assert {c.name: int(c) for c in CalrtCode} == {
        "SUCCESS": 0, "MEM_ALLOC": 1, "ALREADY_REGISTERED": 2, "INVALID_VALUE": 4, "INVALID_CONFIG": 5,
        "ALREADY_CONFIGURED": 7, "DRIVER_INCOMPATIBLE": 8, "RUNTIME_TOO_OLD": 9, "FILE_NOT_FOUND": 10,
        "FILE_READ": 11, "FILE_FORMAT": 12, "TIMEOUT": 13, "OUT_OF_BOUNDS": 14, "UNEXPECTED": 15,
        "MISSING_CONFIG": 16, "DEVICE_BUSY": 17, "DEVICE_UNAVAILABLE": 18, "INVALID_CALBIN": 19,
        "UNKNOWN": 20, "DTYPE_MISMATCH": 21, "SHAPE_MISMATCH": 22, "DEPENDENCY": 23, "MAP_BROKEN": 24,
        "SOFT_RESET_FAILED": 25, "UNSUPPORTED": 27, "DEVICE_CRASH": 28, "WRONG_DIRECTION": 29,
    }
    assert [int(s) for s in DeviceJobStatus] == [0, 1, 2, 3, 4, 5]
    assert DeviceJobStatus(4).name == "DONE_CCU_EXCEPTION"


def test_describe_names_known_and_unknown_codes():
    assert describe(13) == "13 (TIMEOUT)"
    assert describe(26) == "26 (not a CalRT 0.7.6 code)"


SERVICE = {
    Category.INVALID_REQUEST: ("INVALID_ARGUMENT", 400),
    Category.RESOURCE_EXHAUSTED: ("RESOURCE_EXHAUSTED", 429),
    Category.DEADLINE: ("DEADLINE_EXCEEDED", 504),
    Category.CANCELLED: ("CANCELLED", 499),
    Category.UNAVAILABLE: ("UNAVAILABLE", 503),
    Category.DEVICE: ("UNAVAILABLE", 503),
    Category.LIFECYCLE: ("UNAVAILABLE", 503),
    Category.TRANSIENT: ("UNAVAILABLE", 503),
    Category.REQUEST_ARTIFACT: ("INTERNAL", 500),
    Category.ARTIFACT: ("INTERNAL", 500),
    Category.COMPATIBILITY: ("INTERNAL", 500),
    Category.PROGRAMMING: ("INTERNAL", 500),
    Category.INTERNAL: ("INTERNAL", 500),
    Category.UNKNOWN: ("UNKNOWN", 500),
}


@pytest.mark.parametrize("category", list(Category))
def test_every_category_has_the_documented_service_mapping(category):
    mapping = service_mapping(category)
    assert (mapping.grpc_code, mapping.http_status) == SERVICE[category]
