"""What the CLI probe of stop 60 found in the command-line entry points, each pinned
(docs/traceability.md, "Found at stop 60 (cli)")."""

from __future__ import annotations

import functools
import hashlib
import resource
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from calexec import cli
from calexec.contracts.files import new_file_mode
from calexec.drivers.calrt.runtime import CalRT
from calexec.drivers.device_spec import LATENCY_KEYS, emulated_latency_us
from calexec.drivers.synthetic import calbin as calbin_fmt
from executor_harness import short_golden_deadline

#: how a latency key's value may be written: the emulator reads it with strtoll (leading
#: blanks, a sign, leading zeros) and refuses anything after the digits
WRITTEN = ["590000", "+590000", " 590000", "\t590000", "0590000", "+0", "-0", "590000 ",
           "590_000", "٣", "0x5", "-5", "", "60000001", "5e5"]


@pytest.mark.parametrize("key", LATENCY_KEYS)
@pytest.mark.parametrize("value", WRITTEN)
def test_the_latency_a_device_config_asks_for_is_read_as_the_emulator_reads_it(
        key: str, value: str):
    """``emulated_latency_us`` (which moves the warm-up's and the execution's deadlines out)
    read only plain digits: ``prefill_per_token_us=+590000``, which the emulator takes as
    590000, was not counted, so the deadlines stayed where a fast device has them."""
    rc, device = CalRT.load().open_device(f"{key}={value}")
    if device is not None:
        device.close()
    counted = emulated_latency_us(f"kv_blocks=64;{key}={value}").get(key)
    if rc == 0:
        assert counted == int(value.strip()), (value, counted)
    # (a value the runtime refuses is refused at open, whatever is counted for it)


def test_golden_record_with_a_signed_emulated_prefill_slower_than_the_warm_up_deadline(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """``golden record --device-config prefill_per_token_us=+590000`` (the emulator's 0.59 s per
    token: the 17-token golden prefill takes 10.03 s, past the 10 s golden deadline) failed
    its warm-up, exit 3, ``wait.deadline ... (job_id=1 seq_id=0 ...)``, neither flag nor key
    named, where ``=590000`` ran (stop 57): the ``+`` hid the latency from the deadlines.
    (Here the same against a 1 s golden deadline: ``+120000``, a 2.04 s prefill.)"""
    calbin = tmp_path / "model.calbin"
    calbin.write_bytes(calbin_fmt.dumps(calbin_fmt.default_spec()))
    out = tmp_path / "model.goldens.toml"
    with short_golden_deadline(1.0):
        code = cli.main(["golden", "record", "--calbin", str(calbin), "--out", str(out),
                         "--device-config", "prefill_per_token_us=+120000"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert out.exists() and "wait.deadline" not in captured.err


def _limited_to(size: int) -> None:
    # (in the child: a write past `size` bytes fails with EFBIG part way, as on a full disk;
    # Python ignores SIGXFSZ)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))


def test_a_calbin_write_cut_short_leaves_the_old_calbin_as_it_was(tmp_path: Path):
    """``sim write-calbin model.calbin --seed 7`` over a calbin, on a disk that fills part way
    (here a file-size limit of 512 bytes), said ``cannot write ...: File too large``, exit 2,
    and left the old calbin cut to its first 512 bytes: a calbin its pinned golden and every
    command refused (``not a calbin``). The new file replaces the old one only once whole."""
    path = tmp_path / "model.calbin"
    old = calbin_fmt.dumps(calbin_fmt.default_spec())
    path.write_bytes(old)
    run = subprocess.run([sys.executable, "-m", "calexec.cli", "sim", "write-calbin",
                          str(path), "--seed", "7"], capture_output=True, text=True,
                         timeout=120, stdin=subprocess.DEVNULL,
                         preexec_fn=functools.partial(_limited_to, 512))
    assert run.returncode == 2, run.stderr
    assert run.stderr == f"calexec sim write-calbin: cannot write {str(path)!r}: File too large\n"
    assert path.read_bytes() == old
    assert [p.name for p in tmp_path.iterdir()] == ["model.calbin"]  # no scratch file left


def test_a_calbin_written_over_another_keeps_its_mode_and_a_new_one_gets_the_umasks(
        tmp_path: Path):
    path = tmp_path / "model.calbin"
    path.write_bytes(b"old")
    path.chmod(0o640)
    assert cli.main(["sim", "write-calbin", str(path)]) == 0
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert path.read_bytes() == calbin_fmt.dumps(calbin_fmt.default_spec())
    fresh = tmp_path / "fresh.calbin"
    assert cli.main(["sim", "write-calbin", str(fresh)]) == 0
    assert stat.S_IMODE(fresh.stat().st_mode) == new_file_mode()


def test_a_calbin_written_to_a_pipe_goes_through_it(tmp_path: Path):
    """``sim write-calbin /dev/stdout | sha256sum``: the write goes to what the path is (a
    pipe, a device), never a file put in its place."""
    run = subprocess.run([sys.executable, "-m", "calexec.cli", "sim", "write-calbin",
                          "/dev/stdout"], capture_output=True, timeout=120,
                         stdin=subprocess.DEVNULL)
    assert run.returncode == 0, run.stderr
    data = calbin_fmt.dumps(calbin_fmt.default_spec())
    assert run.stdout == data + hashlib.sha256(data).hexdigest().encode() + b"\n"


def test_a_demo_of_one_token_says_it_has_no_tpot_not_nan(capsys: pytest.CaptureFixture[str]):
    """``demo --tokens 1`` (the prefill's token only: no decode step) printed ``tpot nan ms``
    for every sequence, a number that is none."""
    assert cli.main(["demo", "--tokens", "1", "--seqs", "2"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("seq ")]
    assert len(lines) == 2
    for line in lines:
        assert "nan" not in line and "tpot - (one token: no decode step)" in line, line
