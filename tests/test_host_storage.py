"""A generation's host storage (``machines/pool.py`` ``host_array``) is allocated without
zero-filling (``np.empty``): ~32 MB a generation here, filled with zeros only out of habit,
which cost every start, recovery and switch its time. That is sound only if no reader ever
sees a byte nobody wrote: the host writes a job's input rows before it submits, the device
writes the whole output before it reports it valid, and the host reads one logits row of an
output only after that. This test pins it: every host array of the generation is filled with
poison first (a BF16 NaN in the logits, out-of-range token ids and positions in the inputs,
what uninitialised memory may hold), then every kind of job runs at lengths that end inside,
at and past a logits tile, and every answer must be the oracle's, exactly. A reader of an
unwritten output byte would see a NaN (``internal.output_not_finite``) or a wrong token; a
device reading an input row past a job's would fail the position rule or answer wrongly."""

from __future__ import annotations

import numpy as np
import pytest

from calexec.contracts.prepare import InferenceRequest
from calexec.contracts.status import Status
from calexec.contracts.types import TaskKind
from calexec.drivers.synthetic import oracle
from executor_harness import (
    SEED,
    deadline,
    decode,
    prefill,
    running_job_path,
    settle,
    write_calbin,
)

BF16_NAN = 0x7FC0
POISON_ID = -0x5A5A5A5B  # an int32 no token id or position can be


@pytest.fixture(scope="module")
def calbin(tmp_path_factory):
    return write_calbin(tmp_path_factory.mktemp("host_storage"))


def poison(executor) -> int:
    """Fill every host array of the executor's generation with poison; the slot count."""
    slots = executor.pool.slots
    for slot in slots:
        slot.host_output.fill(BF16_NAN)
        if slot.host_input.dtype == np.uint16:  # embeds: BF16 rows
            slot.host_input.fill(BF16_NAN)
        else:
            slot.host_input.fill(POISON_ID)
        slot.host_position.fill(POISON_ID)
    return len(slots)


def answer(executor, request: InferenceRequest):
    result = executor.enqueue(request).wait_until(deadline())
    assert not isinstance(result, Status), result
    return result


def embeds(seq: int, rows: np.ndarray, past: int) -> InferenceRequest:
    return InferenceRequest(seq_id=seq, kind=TaskKind.PREFILL_EMBEDS, embeddings=rows,
                            positions=np.arange(past, past + len(rows), dtype=np.int32),
                            past_len=past, deadline=deadline())


@pytest.mark.parametrize("length", [1, 15, 16, 17, 40])
def test_no_reader_sees_a_host_byte_nobody_wrote(calbin, length):
    with running_job_path(calbin, "kv_blocks=64;kv_block_size=16") as ex:
        settle(ex)  # the start's last golden job has left its slot
        assert poison(ex) > 0
        hidden = ex.pool.generation.hidden_size
        rng = np.random.default_rng(length)
        for seq in (1, 2):  # a second round on the same storage
            ref = oracle.OracleSequence(SEED)
            prompt = [int(t) for t in rng.integers(1, 1000, size=length)]
            first = answer(ex, prefill(seq, prompt))
            ref.run(prompt)
            assert (first.argmax, first.kv_len) == (ref.next_token(), length)
            assert np.all(np.isfinite(first.logits))
            # a prefill of embeddings after it, then decodes: every kind, each past the first
            rows = rng.integers(0, 0x3F80, size=(length, hidden), dtype=np.uint16)
            second = answer(ex, embeds(seq, rows, length))
            ref.run(oracle.embed_tokens(rows))
            assert (second.argmax, second.kv_len) == (ref.next_token(), 2 * length)
            token, past = second.argmax, second.kv_len
            for _ in range(3):
                step = answer(ex, decode(seq, token, past))
                ref.run([token])
                assert (step.argmax, step.kv_len) == (ref.next_token(), past + 1)
                assert np.all(np.isfinite(step.logits))
                token, past = step.argmax, step.kv_len
            released = ex.release_sequence(seq)
            assert released.ok, released
