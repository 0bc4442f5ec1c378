"""Status values, constructors and the llama_decode compatibility code."""

import json

import pytest

from calexec.contracts.codes import DeviceJobStatus
from calexec.contracts.errors import Category
from calexec.contracts.status import Phase, Status, llama_decode_code


def test_ok_singleton():
    assert Status.OK.ok and Status.OK.category is None
    assert (Status.OK.http_status, Status.OK.grpc_code) == (200, "OK")
    assert Status.from_calrt(0, Phase.SUBMIT) is Status.OK
    assert str(Status.OK) == "ok"


def test_from_calrt_classifies_and_names_the_raw_code():
    st = Status.from_calrt(17, Phase.SUBMIT, job_id=7, seq_id=2, generation=3)
    assert not st.ok
    assert (st.code, st.category, st.phase, st.raw) == ("calrt.submit_failed", Category.TRANSIENT, Phase.SUBMIT, 17)
    assert "17 (DEVICE_BUSY)" in st.message
    assert (st.job_id, st.seq_id, st.generation) == (7, 2, 3)
    assert (st.http_status, st.grpc_code) == (503, "UNAVAILABLE")
    unknown = Status.from_calrt(26, Phase.WAIT)
    assert unknown.category is Category.UNKNOWN and "26 (not a CalRT 0.7.6 code)" in unknown.message


def test_step7_and_step8_constructors():
    csr = Status.from_csr(16, "cur_seq_len", 41)
    assert (csr.phase, csr.step, csr.category) == (Phase.CSR, 7, Category.LIFECYCLE)
    assert "cur_seq_len" in csr.message and "41" in csr.message
    assert Status.from_csr(0, "cur_seq_len", 41) is Status.OK
    mapped = Status.from_map(24, "input_ids")
    assert (mapped.phase, mapped.step, mapped.category) == (Phase.MAP, 8, Category.DEVICE)
    sliced = Status.from_slice(14, "positions", 0, 163844)
    assert (sliced.phase, sliced.step, sliced.category) == (Phase.SLICE, 8, Category.REQUEST_ARTIFACT)
    assert "163844" in sliced.message


@pytest.mark.parametrize(
    ("device_status", "code", "category"),
    [(DeviceJobStatus.DONE_CCU_EXCEPTION, "device.ccu_exception", Category.DEVICE),
     (DeviceJobStatus.RUNNING, "device.status_not_done", Category.UNKNOWN),
     (9, "device.status_not_done", Category.UNKNOWN)],
)
def test_device_status_other_than_done_fails(device_status, code, category):
    st = Status.from_device_status(device_status, job_id=1)
    assert (st.code, st.category, st.phase, st.job_id) == (code, category, Phase.STATUS, 1)
    assert Status.from_device_status(DeviceJobStatus.DONE) is Status.OK


def test_named_constructors():
    assert Status.invalid(2, "past_len=5").to_dict()["step"] == 2
    assert Status.invalid(2, "past_len=5").message == "step 2: past_len=5"
    assert Status.cancelled(Phase.ADMISSION).category is Category.CANCELLED
    dl = Status.deadline(Phase.ADMISSION)
    assert (dl.code, dl.http_status) == ("admission.deadline", 504)
    kv = Status.exhausted("kv", Phase.ADMISSION, "canAllocate(1)=false until deadline")
    assert (kv.code, kv.http_status, kv.grpc_code) == ("kv.full", 429, "RESOURCE_EXHAUSTED")
    assert Status.unavailable(Phase.ADMISSION, "lifecycle=Recovering").http_status == 503
    assert Status.internal("non_finite", Phase.OUTPUT_CHECK, "logits[3]=nan").code == "internal.non_finite"
    assert Status.artifact("model_missing", "x").category is Category.ARTIFACT


def test_bad_codes_and_inconsistent_values_are_rejected():
    with pytest.raises(ValueError, match="Status.code='Bad Code'"):
        Status.failure("Bad Code", Category.INTERNAL, Phase.COMMIT, "x")
    with pytest.raises(ValueError, match="category"):
        Status(code="ok", category=Category.INTERNAL)
    with pytest.raises(ValueError, match="category"):
        Status(code="x.y")


def test_with_context_keeps_unset_fields():
    st = Status.from_calrt(13, Phase.WAIT, job_id=1)
    st2 = st.with_context(seq_id=4, generation=2)
    assert (st2.job_id, st2.seq_id, st2.generation, st2.raw) == (1, 4, 2, 13)
    assert st.seq_id is None  # frozen: the original is unchanged
    assert st.with_context() is st
    assert "seq_id=4" in str(st2) and "calrt.wait_failed" in str(st2)


def test_to_dict_is_json_ready_and_complete():
    d = Status.from_calrt(28, Phase.WAIT, job_id=9).to_dict()
    assert json.loads(json.dumps(d)) == d
    assert d["category"] == "device" and d["phase"] == "wait" and d["raw_name"] == "28 (DEVICE_CRASH)"
    assert set(d) == set(Status.OK.to_dict())


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        (Status.OK, 0),
        (Status.exhausted("kv", Phase.ADMISSION, "full"), 1),
        (Status.cancelled(Phase.WAIT), 2),
        (Status.deadline(Phase.WAIT), 2),
        (Status.invalid(1, "token_count=0"), -1),
        (Status.from_calrt(28, Phase.WAIT), -2),
        (Status.from_calrt(13, Phase.WAIT), -2),
        (Status.unavailable(Phase.ADMISSION, "draining"), -2),
        (Status.internal("short_output", Phase.OUTPUT_CHECK, "x"), -2),
    ],
)
def test_llama_decode_code(status, expected):
    assert llama_decode_code(status) == expected
