"""§4.1/§4.2 value types: their validators are the contract."""

import pytest

from calexec.contracts.runtime_view import RuntimeTensorInfo
from calexec.contracts.types import (
    DType,
    EngineSlot,
    FieldError,
    JobTimings,
    KvTxnRecord,
    ModelGeneration,
    SubmodelContract,
    TaskKind,
    TensorContract,
)


def tensor(name, shape, dtype, sliceable=False, byte_size=None):
    size = 1
    for d in shape:
        size *= d
    return TensorContract(name, shape, dtype, byte_size if byte_size is not None else size * DType(dtype).itemsize,
                          sliceable)


def decode(**changes):
    fields = dict(kind=TaskKind.DECODE, exact_name="dec", token_or_embed=tensor("ids", [1, 1], "S32"),
                  position=tensor("pos", [1, 1], "S32"), logits=tensor("logits", [1, 1, 8], "BF16"),
                  csr_cur_seq="cur", csr_total_seq="total", max_batch=1, max_seq=64, logits_tile_d0=1)
    fields.update(changes)
    return SubmodelContract(**fields)


def test_enums_match_the_spec():
    assert [int(k) for k in TaskKind] == [0, 1, 2, 3]
    assert (int(EngineSlot.AUTO), int(EngineSlot.PING), int(EngineSlot.PONG)) == (-1, 0, 1)
    assert {d.value: d.itemsize for d in DType} == {"S32": 4, "BF16": 2, "F32": 4, "F16": 2, "U8": 1, "S8": 1}
    assert all(d.host_dtype.itemsize == d.itemsize for d in DType)
    # the runtime view's dtype strings are DType values
    assert DType(RuntimeTensorInfo("x", (1,), "BF16", 2, False).dtype) is DType.BF16


def test_tensor_byte_size_must_equal_shape_times_itemsize():
    assert tensor("logits", [1, 16, 151936], "BF16").byte_size == 4861952
    with pytest.raises(FieldError, match=r"byte_size=4861953.*= 4861952") as info:
        tensor("logits", [1, 16, 151936], "BF16", byte_size=4861953)
    assert info.value.field == "byte_size"
    with pytest.raises(FieldError, match="dtype='Q8'"):
        TensorContract("x", [1], "Q8", 1, False)
    with pytest.raises(FieldError, match=r"shape=\[1, 0\]"):
        tensor("x", [1, 0], "S32")


def test_submodel_checks_tile_rows_and_batch_dimension():
    assert decode().logits_tile_d0 == 1
    with pytest.raises(FieldError, match="logits_tile_d0=16") as info:
        decode(logits_tile_d0=16)
    assert info.value.field == "logits_tile_d0"
    with pytest.raises(FieldError, match="position.shape"):
        decode(position=tensor("pos", [2, 1], "S32"))
    with pytest.raises(FieldError, match="max_seq=0"):
        decode(max_seq=0)
    with pytest.raises(FieldError, match="max_seq=2147483648"):
        decode(max_seq=2**31)


SHA = "ab" * 32


def test_model_generation_validates_and_looks_up_exactly():
    gen = ModelGeneration(1, SHA, "0.7.6", {TaskKind.DECODE: decode()}, vocab_size=8, hidden_size=4)
    assert gen.submodel(TaskKind.DECODE).exact_name == "dec"
    missing = gen.submodel(TaskKind.VISION)
    assert not missing.ok and missing.code == "lookup.no_submodel" and "VISION" in missing.message
    with pytest.raises(TypeError):
        gen.submodels[TaskKind.VISION] = decode()  # read-only mapping
    with pytest.raises(FieldError, match="calbin_sha256='AB"):
        ModelGeneration(1, SHA.upper(), "0.7.6", {TaskKind.DECODE: decode()}, vocab_size=8, hidden_size=4)
    with pytest.raises(FieldError, match="vocab_size=9"):
        ModelGeneration(1, SHA, "0.7.6", {TaskKind.DECODE: decode()}, vocab_size=9, hidden_size=4)
    with pytest.raises(FieldError, match="stored under kind PREFILL_IDS"):
        ModelGeneration(1, SHA, "0.7.6", {TaskKind.PREFILL_IDS: decode()}, vocab_size=8, hidden_size=4)


def test_job_timings_spans():
    t = JobTimings(accepted_us=1_000, admitted_us=1_500, queued_us=2_000)
    assert t.admission_wait_ms() == 0.5
    assert t.queue_wait_ms() is None  # not submitted yet
    t.submitted_us, t.completed_us = 4_000, 14_000
    assert (t.queue_wait_ms(), t.execution_ms(), t.total_ms()) == (2.0, 10.0, 13.0)
    d = t.to_dict()
    assert d["execution_ms"] == 10.0 and d["accepted_us"] == 1_000
    with pytest.raises(AttributeError):
        t.not_a_field = 1  # slots


def test_kv_txn_record():
    rec = KvTxnRecord(seq_id=3, old_len=10, target_len=26, generation_id=2)
    assert rec.token_count == 16
    with pytest.raises(FieldError, match="target_len=9"):
        KvTxnRecord(seq_id=3, old_len=10, target_len=9, generation_id=2)
    with pytest.raises(FieldError, match="old_len=4294967296"):
        KvTxnRecord(seq_id=3, old_len=2**32, target_len=2**32, generation_id=2)
    with pytest.raises(FieldError, match="seq_id=-1"):
        KvTxnRecord(seq_id=-1, old_len=0, target_len=1, generation_id=2)
