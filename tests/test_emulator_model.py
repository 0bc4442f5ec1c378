"""The emulator's synthetic Qwen3 model against the numpy oracle, and KV length semantics."""

from __future__ import annotations

import numpy as np
import pytest

from calexec.drivers.calrt.runtime import CalRT, JobStatus
from calexec.drivers.direct import DirectRunner, check
from calexec.drivers.synthetic import calbin, oracle

SEED = 0xBADC0DE


@pytest.fixture(scope="module")
def rt() -> CalRT:
    return CalRT.load()


def _runner(rt: CalRT, tmp_path, tile_d0: int = 16, config: str = "") -> DirectRunner:
    path = tmp_path / f"q_{tile_d0}.calbin"
    calbin.write(str(path), calbin.default_spec(tile_d0=tile_d0, seed=SEED))
    return DirectRunner(rt, str(path), config)


@pytest.fixture
def runner(rt, tmp_path):
    r = _runner(rt, tmp_path)
    yield r
    r.close()


def _prompt(n: int, salt: int = 0) -> list[int]:
    return [(i * 2654435761 + salt * 97) % calbin.VOCAB for i in range(n)]


@pytest.mark.parametrize("tile_d0", [16, 8, 7])
def test_prefill_ids_full_tile_matches_oracle(rt, tmp_path, tile_d0):
    r = _runner(rt, tmp_path, tile_d0)
    try:
        for seq, n in enumerate([1, 2, 7, 8, 15, 16, 17, 33]):
            tokens = _prompt(n, seq)
            row = r.run(calbin.PREFILL_IDS, seq, 0, tokens=tokens)
            expect = oracle.OracleSequence(SEED).prefill(tokens, tile_d0)
            out = r.slot(calbin.PREFILL_IDS).logits
            assert out.shape == (1, tile_d0, calbin.VOCAB)
            assert np.array_equal(out, expect), f"n={n} tile_d0={tile_d0}"
            assert np.array_equal(row, expect[0, oracle.valid_row(n, tile_d0)])
            assert r.kv.seq_len(seq) == (0, n)
    finally:
        r.close()


def test_argmax_is_unique_and_is_state_mod_vocab():
    state = oracle.mix(oracle.initial_state(SEED), 42, 0)
    row = oracle.bf16_to_f32(oracle.logits_bf16(state))
    top = int(np.argmax(row))
    assert top == state % calbin.VOCAB
    assert row[top] == 8.0 and np.count_nonzero(row == 8.0) == 1


def test_decode_after_prefill_greedy_matches_oracle(runner):
    prompt = _prompt(17)
    ref = oracle.OracleSequence(SEED)
    ref.prefill(prompt, 16)
    row = runner.run(calbin.PREFILL_IDS, 0, 0, tokens=prompt)
    for step in range(6):
        token = int(np.argmax(oracle.bf16_to_f32(row)))
        assert token == ref.next_token()
        row = runner.run(calbin.DECODE, 0, len(prompt) + step, tokens=[token])
        assert np.array_equal(row, ref.decode(token)[0, 0])
    assert runner.kv.seq_len(0) == (0, len(prompt) + 6)


def test_prefill_embeds_matches_oracle(runner):
    rng = np.random.default_rng(7)
    embeds = rng.integers(0, 2**16, size=(19, calbin.DEFAULT_HIDDEN), dtype=np.uint16)
    runner.run(calbin.PREFILL_EMBEDS, 3, 0, embeds=embeds)
    expect = oracle.OracleSequence(SEED).prefill(oracle.embed_tokens(embeds), 16)
    assert np.array_equal(runner.slot(calbin.PREFILL_EMBEDS).logits, expect)


def test_decoy_graph_differs_from_decode(runner):
    prompt = _prompt(5)
    runner.run(calbin.PREFILL_IDS, 0, 0, tokens=prompt)
    real = runner.run(calbin.DECODE, 0, 5, tokens=[11]).copy()
    decoy = runner.run(calbin.DECOY, 0, 5, tokens=[11])  # rewinds to past 5: same state
    assert not np.array_equal(real, decoy)
    ref = oracle.OracleSequence(SEED, salt=calbin.DECOY_SALT)
    ref.run(prompt)
    assert np.array_equal(decoy, ref.decode(11)[0, 0])


def test_two_sequences_stay_independent(runner):
    refs = [oracle.OracleSequence(SEED), oracle.OracleSequence(SEED)]
    prompts = [_prompt(9, 1), _prompt(4, 2)]
    for seq in (0, 1):
        runner.run(calbin.PREFILL_IDS, seq, 0, tokens=prompts[seq])
        refs[seq].run(prompts[seq])
    for step in range(5):
        for seq in (0, 1):
            token = refs[seq].next_token()
            past = refs[seq].length
            row = runner.run(calbin.DECODE, seq, past, tokens=[token])
            assert np.array_equal(row, refs[seq].decode(token)[0, 0]), (seq, step)
    assert runner.kv.seq_len(0) == (0, 14) and runner.kv.seq_len(1) == (0, 9)


def test_apply_reserves_exact_blocks_and_can_allocate(rt, tmp_path):
    r = _runner(rt, tmp_path, config="kv_blocks=8;kv_block_size=4")
    try:
        kv = r.kv
        assert (kv.block_size, kv.capacity_blocks) == (4, 8)
        assert kv.apply(0, 9)  # ceil(9/4) = 3 blocks
        assert kv.free_blocks() == (0, 5)
        assert kv.can_allocate(5) and not kv.can_allocate(6)
        assert kv.apply(0, 4)  # shrink to 1 block
        assert kv.free_blocks() == (0, 7)
        assert not kv.apply(1, 33)  # 9 blocks > 7 free: refused, nothing reserved
        assert kv.free_blocks() == (0, 7)
        assert not kv.apply(-1, 1) and not kv.apply(kv.max_seqs, 1)
        assert not kv.apply(0, calbin.MAX_SEQ + 1)
        assert kv.release(0) == 0 and kv.free_blocks() == (0, 8)
    finally:
        r.close()


def test_shrinking_apply_truncates_and_rewind_continues_from_past(runner):
    prompt = _prompt(10)
    runner.run(calbin.PREFILL_IDS, 0, 0, tokens=prompt)
    assert runner.kv.apply(0, 4)
    assert runner.kv.seq_len(0) == (0, 4)
    # A job at past 4 (<= committed) continues from the state after 4 tokens.
    row = runner.run(calbin.DECODE, 0, 4, tokens=[99])
    ref = oracle.OracleSequence(SEED)
    ref.run(prompt[:4])
    assert np.array_equal(row, ref.decode(99)[0, 0])
    assert runner.kv.seq_len(0) == (0, 5)
    # Rewind without truncation: past 2 < committed 5.
    row = runner.run(calbin.DECODE, 0, 2, tokens=[5])
    ref2 = oracle.OracleSequence(SEED)
    ref2.run(prompt[:2])
    assert np.array_equal(row, ref2.decode(5)[0, 0])
    assert runner.kv.seq_len(0) == (0, 3)
    assert runner.kv.release(0) == 0 and runner.kv.seq_len(0) == (0, 0)


def _submit_raw(r: DirectRunner, seq: int, past: int, token: int, position: int | None = None) -> int:
    """A decode job without Apply (to break the KV rules on purpose)."""
    s = r.slot(calbin.DECODE)
    s.inputs["input_ids"][0, 0] = token
    s.inputs["positions"][0, 0] = past if position is None else position
    check(s.inbuf.set_csr("cur_seq_len", 1), "csr")
    check(s.inbuf.set_csr("total_seq_len", past + 1), "csr")
    return r.device.infer(s.model, r.kv, seq, s.inbuf, s.outbuf)


def test_job_beyond_reservation_ends_ccu_exception(rt, tmp_path):
    r = _runner(rt, tmp_path, config="kv_block_size=4")
    try:
        r.run(calbin.PREFILL_IDS, 0, 0, tokens=_prompt(4))  # reservation: exactly 1 block
        assert _submit_raw(r, 0, 4, 1) == 0  # infer accepts; the device refuses
        assert r.finish(calbin.DECODE) == JobStatus.DONE_CCU_EXCEPTION
        assert r.kv.seq_len(0) == (0, 4)
        assert r.device.emu.counters()["ccu_exceptions"] == 1
    finally:
        r.close()


def test_past_beyond_committed_and_bad_positions_end_ccu_exception(runner):
    runner.run(calbin.PREFILL_IDS, 0, 0, tokens=_prompt(3))
    assert runner.kv.apply(0, 100)
    assert _submit_raw(runner, 0, 5, 1) == 0  # committed is 3
    assert runner.finish(calbin.DECODE) == JobStatus.DONE_CCU_EXCEPTION
    assert _submit_raw(runner, 0, 3, 1, position=4) == 0  # positions must be past + i
    assert runner.finish(calbin.DECODE) == JobStatus.DONE_CCU_EXCEPTION
    assert runner.kv.seq_len(0) == (0, 3)
    assert _submit_raw(runner, 0, 3, 1) == 0
    assert runner.finish(calbin.DECODE) == JobStatus.DONE
    assert runner.kv.seq_len(0) == (0, 4)
