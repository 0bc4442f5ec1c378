"""The cffi driver and the C ABI contract: model introspection, bad handles, names, sizes,
dtypes and slices return codes (never crash), calbin format, and the dlopen path."""

from __future__ import annotations

import hashlib
import os
import subprocess

import numpy as np
import pytest

from calexec.contracts.runtime_view import RuntimeModelInfo
from calexec.drivers import calrt as calrt_pkg
from calexec.drivers.calrt.runtime import CalRT, Did, JobStatus, Rc, Stage
from calexec.drivers.direct import DirectRunner, check
from calexec.drivers.synthetic import calbin, oracle
from calexec.drivers.tools.bench import sim as simbench

SEED = 5
CALRT_DIR = os.path.dirname(calrt_pkg.__file__)  # drivers/calrt: Makefile and the C sources


def test_models_report_exact_names_tensors_csrs_and_meta(runner):
    rc, models = runner.calbin.models()
    assert rc == 0
    names = [m.info.name for m in models]
    assert names == [calbin.PREFILL_IDS, calbin.PREFILL_EMBEDS, calbin.DECODE, calbin.DECOY]
    info = runner.models[calbin.PREFILL_IDS].info
    assert isinstance(info, RuntimeModelInfo)
    ids, pos = info.inputs
    assert (ids.name, ids.dtype, ids.shape, ids.byte_size, ids.sliceable) == (
        "input_ids", "S32", (1, calbin.MAX_SEQ), 4 * calbin.MAX_SEQ, True)
    assert pos.name == "positions"
    (logits,) = info.outputs
    assert (logits.dtype, logits.shape, logits.sliceable) == ("BF16", (1, 16, calbin.VOCAB), False)
    assert info.csr_names == ("cur_seq_len", "total_seq_len")
    assert info.meta == {"logits_tile_d0": 16, "max_seq": calbin.MAX_SEQ, "max_batch": 1,
                         "vocab": calbin.VOCAB, "hidden": calbin.DEFAULT_HIDDEN}
    dec = runner.models[calbin.DECODE]
    assert dec.info.inputs[0].shape == (1, 1) and not dec.info.inputs[0].sliceable
    assert dec.meta("logits_tile_d0") == (0, 1)
    assert dec.meta("no_such_key")[0] == Rc.ERR_INVALID_VALUE


def test_calbin_sha256_and_format_round_trip(calbin_path, tmp_path):
    with open(calbin_path, "rb") as f:
        data = f.read()
    spec = calbin.default_spec(seed=SEED)
    assert calbin.dumps(spec) == data  # deterministic bytes
    assert calbin.loads(data) == spec
    rc, dev = CalRT.load().open_device()
    rc, cb = dev.load_calbin(calbin_path)
    assert rc == 0 and cb.sha256 == hashlib.sha256(data).hexdigest()
    other = tmp_path / "t8.calbin"
    assert simbench.main(["sim", "write-calbin", str(other), "--tile-d0", "8", "--seed", str(SEED)]) == 0
    rc, cb8 = dev.load_calbin(str(other))
    assert rc == 0 and cb8.sha256 != cb.sha256
    assert calbin.read(str(other)).model(calbin.PREFILL_IDS).outputs[0].shape == (1, 8, calbin.VOCAB)
    # one grammar for both loaders: a blank line is refused by Python and by C (19)
    blank = tmp_path / "blank.calbin"
    blank.write_bytes(data.replace(b"\nend\n", b"\n\nend\n", 1))
    with pytest.raises(ValueError, match="blank line"):
        calbin.loads(blank.read_bytes())
    assert dev.load_calbin(str(blank))[0] == Rc.ERR_INVALID_CALBIN
    assert dev.close() == 0


def test_calbin_load_errors(tmp_path):
    rc, dev = CalRT.load().open_device()
    assert dev.load_calbin(str(tmp_path / "missing.calbin"))[0] == Rc.ERR_FILE_NOT_FOUND
    bad = tmp_path / "bad.calbin"
    bad.write_bytes(b"NOT A CALBIN\n")
    assert dev.load_calbin(str(bad))[0] == Rc.ERR_FILE_FORMAT
    text = calbin.dumps(calbin.default_spec()).replace(b"output logits BF16 0 1,16,", b"output logits BF16 0 1,15,")
    bad.write_bytes(text)  # tile shape disagrees with logits_tile_d0
    assert dev.load_calbin(str(bad))[0] == Rc.ERR_INVALID_CALBIN
    bad.write_bytes(b"CALBIN 1\nseed 1\nbogus line\n")
    assert dev.load_calbin(str(bad))[0] == Rc.ERR_INVALID_CALBIN
    assert dev.close() == 0


def test_device_config_is_validated():
    rt = CalRT.load()
    assert rt.open_device("no_such_knob=1")[0] == Rc.ERR_INVALID_CONFIG
    assert rt.open_device("queue_depth=0")[0] == Rc.ERR_INVALID_CONFIG
    assert rt.open_device("overlap=sideways")[0] == Rc.ERR_INVALID_CONFIG
    rc, dev = rt.open_device("overlap=dma; kv_after_failed_wait=partial;queue_depth=2")
    assert rc == 0
    assert dev.emu.get_knob("overlap") == (0, 1)
    assert dev.emu.get_knob("kv_after_failed_wait") == (0, 1)
    assert dev.emu.set_knob("kv_blocks", 5) == Rc.ERR_INVALID_CONFIG  # open-time only
    assert dev.emu.set_knob("queue_depth", 0) == Rc.ERR_INVALID_VALUE
    assert dev.close() == 0


def test_stale_null_and_forged_handles_return_invalid_value(runner):
    rt = runner.device.rt
    lib, ffi = rt.lib, rt.ffi
    s = runner.slot(calbin.DECODE)
    forged = ffi.cast("calrt_device *", 0xDEADBEEF)
    assert lib.calrt_reset(forged) == Rc.ERR_INVALID_VALUE
    assert lib.calrt_wait(ffi.NULL, 0) == Rc.ERR_INVALID_VALUE
    assert lib.calrt_infer(ffi.NULL, ffi.NULL, ffi.NULL, 0, ffi.NULL, ffi.NULL) == Rc.ERR_INVALID_VALUE
    assert lib.calrt_kv_can_allocate(ffi.NULL, 1) == 0
    # Handles of the wrong type are refused by their type tag.
    assert lib.calrt_wait(ffi.cast("calrt_outputbuf *", s.inbuf.handle), 0) == Rc.ERR_INVALID_VALUE
    rc, inb = s.model.create_input_buf()
    assert rc == 0 and inb.destroy() == 0
    assert inb.set_csr("cur_seq_len", 1) == Rc.ERR_INVALID_VALUE
    assert inb.destroy() == Rc.ERR_INVALID_VALUE
    other_rc, other = rt.open_device()
    assert other_rc == 0
    assert other.infer(s.model, runner.kv, 0, s.inbuf, s.outbuf) == Rc.ERR_INVALID_VALUE  # foreign handles
    assert other.close() == 0
    assert other.close() == Rc.ERR_INVALID_VALUE
    assert other.reset() == Rc.ERR_INVALID_VALUE


def test_close_invalidates_every_handle(calbin_path):
    r = DirectRunner(CalRT.load(), calbin_path)
    row = r.run(calbin.DECODE, 0, 0, tokens=[1]).copy()
    s = r.slot(calbin.DECODE)
    assert r.close() == 0
    assert s.outbuf.wait(0) == Rc.ERR_INVALID_VALUE
    assert s.outbuf.get_status()[0] == Rc.ERR_INVALID_VALUE
    assert r.kv.seq_len(0)[0] == Rc.ERR_INVALID_VALUE
    assert r.calbin.models()[0] == Rc.ERR_INVALID_VALUE
    assert s.inbuf.map("input_ids", s.inputs["input_ids"]) == Rc.ERR_INVALID_VALUE
    assert r.device.emu.counters() == {}
    assert np.array_equal(row, oracle.OracleSequence(SEED).decode(1)[0, 0])


def test_map_checks_name_dtype_size(runner):
    s = runner.slot(calbin.PREFILL_IDS)
    ib, ob = s.inbuf, s.outbuf
    assert ib.map("no_such_tensor", np.zeros(4, np.int32)) == Rc.ERR_INVALID_VALUE
    assert ib.map("input_ids", np.zeros(4, np.float32)) == Rc.ERR_DTYPE_MISMATCH
    assert ib.map("input_ids", np.zeros(calbin.MAX_SEQ + 1, np.int32)) == Rc.ERR_OUT_OF_BOUNDS
    assert ob.map("logits", np.zeros(8, np.float32)) == Rc.ERR_DTYPE_MISMATCH
    assert ob.map("input_ids", np.zeros(8, np.uint16)) == Rc.ERR_INVALID_VALUE
    with pytest.raises(ValueError, match="C-contiguous"):
        ib.map("input_ids", np.zeros((4, 4), np.int32)[:, 0])
    with pytest.raises(ValueError, match="dtype"):
        ib.map("input_ids", np.zeros(4, np.complex64))


def test_slice_checks_and_active_slice_query(runner):
    s = runner.slot(calbin.PREFILL_IDS)
    ib = s.inbuf
    assert ib.active_slices() == (0, 0)
    assert ib.slice("input_ids", 0, 0) == Rc.ERR_INVALID_VALUE
    assert ib.slice("input_ids", calbin.MAX_SEQ, 1) == Rc.ERR_OUT_OF_BOUNDS
    assert ib.slice("input_ids", 1, calbin.MAX_SEQ) == Rc.ERR_OUT_OF_BOUNDS
    assert ib.slice("input_ids", 2**64 - 1, 2) == Rc.ERR_OUT_OF_BOUNDS  # no overflow
    assert ib.slice("nope", 0, 1) == Rc.ERR_INVALID_VALUE
    assert runner.slot(calbin.DECODE).inbuf.slice("input_ids", 0, 1) == Rc.ERR_UNSUPPORTED
    assert ib.slice("input_ids", 0, 3) == 0 and ib.slice("positions", 0, 3) == 0
    assert ib.active_slices() == (0, 2)
    assert ib.undo_slice("input_ids") == 0 and ib.undo_slice("nope") == Rc.ERR_INVALID_VALUE
    assert ib.active_slices() == (0, 1)


def test_slice_must_be_whole_rows_and_a_row_aligned_offset_is_read(runner):
    """calrt.h: SliceTensor refuses an offset or count that is not a whole number of rows
    with 4 (a row of inputs_embeds is `hidden` elements), so infer() never sees one; a slice
    of whole rows at an offset is taken and the job reads its rows from there."""
    s = runner.slot(calbin.PREFILL_EMBEDS)
    ib, h = s.inbuf, calbin.DEFAULT_HIDDEN
    assert s.row_elems["inputs_embeds"] == h > 1
    assert ib.slice("inputs_embeds", 1, 3 * h) == Rc.ERR_INVALID_VALUE  # offset inside a row
    assert ib.slice("inputs_embeds", 2 * h, 3 * h - 1) == Rc.ERR_INVALID_VALUE  # partial last row
    assert ib.slice("inputs_embeds", 0, 1) == Rc.ERR_INVALID_VALUE
    assert ib.slice("inputs_embeds", 1, calbin.MAX_SEQ * h) == Rc.ERR_OUT_OF_BOUNDS  # range first
    assert ib.active_slices() == (0, 0)  # a refused slice leaves nothing behind
    # Rows 2..4 of the host arrays hold a 3-token prefill.
    embeds = np.random.default_rng(3).integers(0, 2**16, size=(3, h), dtype=np.uint16)
    s.inputs["inputs_embeds"][0, 2:5] = embeds
    s.inputs["positions"][0, 2:5] = [0, 1, 2]
    assert ib.slice("inputs_embeds", 2 * h, 3 * h) == 0 and ib.slice("positions", 2, 3) == 0
    check(ib.set_csr("cur_seq_len", 3), "csr")
    check(ib.set_csr("total_seq_len", 3), "csr")
    assert runner.kv.apply(1, 3)
    assert runner.device.infer(s.model, runner.kv, 1, ib, s.outbuf) == 0
    assert runner.finish(calbin.PREFILL_EMBEDS) == JobStatus.DONE
    expect = oracle.OracleSequence(SEED).prefill(oracle.embed_tokens(embeds), 16)
    assert np.array_equal(s.logits, expect)


def test_infer_validation_codes(runner, calbin_path):
    d, kv = runner.device, runner.kv
    s = runner.slot(calbin.DECODE)
    m = s.model
    s.inputs["positions"][0, 0] = 0
    assert s.inbuf.set_csr("no_such_csr", 1) == Rc.ERR_INVALID_VALUE
    rc, fresh = m.create_input_buf()
    assert d.infer(m, kv, 0, fresh, s.outbuf) == Rc.ERR_INVALID_VALUE  # CSRs/tensors unset
    check(fresh.set_csr("cur_seq_len", 1), "csr")
    check(fresh.set_csr("total_seq_len", 1), "csr")
    assert d.infer(m, kv, 0, fresh, s.outbuf) == Rc.ERR_INVALID_VALUE  # unmapped tensors
    ib = s.inbuf
    assert kv.apply(0, 1)
    check(ib.set_csr("cur_seq_len", 1), "csr")
    check(ib.set_csr("total_seq_len", 0), "csr")
    assert d.infer(m, kv, 0, ib, s.outbuf) == Rc.ERR_INVALID_VALUE  # total < cur
    check(ib.set_csr("total_seq_len", calbin.MAX_SEQ + 1), "csr")
    assert d.infer(m, kv, 0, ib, s.outbuf) == Rc.ERR_OUT_OF_BOUNDS
    check(ib.set_csr("cur_seq_len", 2), "csr")
    check(ib.set_csr("total_seq_len", 2), "csr")
    assert d.infer(m, kv, 0, ib, s.outbuf) == Rc.ERR_OUT_OF_BOUNDS  # decode has one row
    check(ib.set_csr("cur_seq_len", 1), "csr")
    check(ib.set_csr("total_seq_len", 1), "csr")
    assert d.infer(m, kv, -1, ib, s.outbuf) == Rc.ERR_INVALID_VALUE
    assert d.infer(m, kv, kv.max_seqs, ib, s.outbuf) == Rc.ERR_INVALID_VALUE
    other = runner.slot(calbin.DECOY)
    assert d.infer(m, kv, 0, other.inbuf, s.outbuf) == Rc.ERR_INVALID_VALUE  # buffer of another model
    assert d.infer_with_fixed_task_type(m, kv, 0, ib, s.outbuf, 7) == Rc.ERR_INVALID_VALUE
    rc, short_out = m.create_output_buf()
    check(short_out.map("logits", np.zeros(16, np.uint16)), "map")
    assert d.infer(m, kv, 0, ib, short_out) == Rc.ERR_SHAPE_MISMATCH
    # A prefill whose valid region is smaller than cur_seq_len.
    p = runner.slot(calbin.PREFILL_IDS)
    check(p.inbuf.slice("input_ids", 0, 2), "slice")
    check(p.inbuf.set_csr("cur_seq_len", 3), "csr")
    check(p.inbuf.set_csr("total_seq_len", 3), "csr")
    assert d.infer(p.model, kv, 0, p.inbuf, p.outbuf) == Rc.ERR_OUT_OF_BOUNDS
    assert d.infer(m, kv, 0, ib, s.outbuf) == 0
    assert runner.finish(calbin.DECODE) == JobStatus.DONE


def test_lifecycle_codes(runner, calbin_path):
    d = runner.device
    assert d.configure(runner.calbin) == Rc.ERR_ALREADY_CONFIGURED
    assert d.create_kv(runner.calbin)[0] == Rc.ERR_ALREADY_REGISTERED
    assert runner.calbin.unload() == Rc.ERR_DEVICE_BUSY
    rc, cb2 = d.load_calbin(calbin_path)
    assert rc == 0 and cb2.unload() == 0 and cb2.unload() == Rc.ERR_INVALID_VALUE
    emu = d.emu
    check(emu.set_stepped(True), "stepped")
    assert runner.submit(calbin.DECODE, 0, 0, tokens=[1]) == 0
    s = runner.slot(calbin.DECODE)
    assert s.outbuf.destroy() == Rc.ERR_DEVICE_BUSY
    assert s.inbuf.destroy() == Rc.ERR_DEVICE_BUSY
    assert runner.kv.destroy() == Rc.ERR_DEVICE_BUSY
    assert s.outbuf.map("logits", s.logits) == Rc.ERR_DEVICE_BUSY
    assert emu.step(0, Stage.JOB) == (0, Did.SIGNAL)
    assert s.outbuf.destroy() == 0 and s.inbuf.destroy() == 0


def test_wait_without_a_job_is_invalid(runner):
    assert runner.slot(calbin.DECODE).outbuf.wait(0) == Rc.ERR_INVALID_VALUE
    assert runner.slot(calbin.DECODE).outbuf.get_status() == (0, JobStatus.IDLE)


def test_a_library_named_by_its_file_name_in_the_current_directory_loads(tmp_path, monkeypatch):
    """``calexec conform --lib libcalrt_emu.so`` (or ``demo --runtime-lib``, or
    ``CALEXEC_CALRT_LIB``) run in the library's directory: the flag's check found the file, then
    dlopen, which looks a name without ``/`` up in the system's library path only, said
    ``cannot open shared object file: No such file or directory``, exit 2. The file the name
    names in the current directory is loaded."""
    out = tmp_path / "lib"
    subprocess.run(["make", "-s", "-C", CALRT_DIR, "lib", f"O={out}"], check=True, capture_output=True)
    monkeypatch.chdir(out)
    rt = CalRT.load("libcalrt_emu.so")
    assert rt.path == "libcalrt_emu.so" and rt.has_emu and rt.version == "0.7.6-emu"
    monkeypatch.setenv("CALEXEC_CALRT_LIB", "libcalrt_emu.so")
    assert CalRT.load().version == "0.7.6-emu"
    with pytest.raises(OSError, match="no_such_lib.so"):  # a name of no file: dlopen's search
        CalRT.load("no_such_lib.so")


def test_dlopen_path_runs_a_decode(tmp_path, calbin_path, monkeypatch):
    out = tmp_path / "lib"
    subprocess.run(["make", "-s", "-C", CALRT_DIR, "lib", f"O={out}"], check=True, capture_output=True)
    lib_path = str(out / "libcalrt_emu.so")
    rt = CalRT.load(lib_path)
    assert rt.path == lib_path and rt.has_emu and rt.version == "0.7.6-emu"
    r = DirectRunner(rt, calbin_path)
    tokens = [5, 6, 7]
    r.run(calbin.PREFILL_IDS, 0, 0, tokens=tokens)
    row = r.run(calbin.DECODE, 0, 3, tokens=[8])
    ref = oracle.OracleSequence(SEED)
    ref.run(tokens)
    assert np.array_equal(row, ref.decode(8)[0, 0])
    assert r.close() == 0
    monkeypatch.setenv("CALEXEC_CALRT_LIB", lib_path)
    assert CalRT.load().path == lib_path
    monkeypatch.delenv("CALEXEC_CALRT_LIB")
    assert CalRT.load().path is None
