"""Found by the lead at stop 73 (the adversary probe's hand-back): a restore (a recovery, a
refused switch's roll back) loaded the calbin that served again from its *path*, whatever
was written there since. A reload of the serving path whose new file was refused rolled back
onto that refused file and the lifecycle ended Failed; a recovery after a deploy replaced the
file switched models unasked. machines/served_files.py holds what served open."""

from __future__ import annotations

import os
from pathlib import Path

from calexec.contracts.errors import Category
from calexec.contracts.status import Phase, Status
from calexec.drivers.synthetic import calbin
from calexec.machines.served_files import HELD_MAX, ServedFiles
from tests.test_server_support import started_executor

OTHER_SEED = 12345  # a calbin of another model, whose golden nobody pinned: always refused


def _replace_by_rename(path: Path, seed: int) -> None:
    """What a deploy script does: a new file written beside, renamed over the path."""
    new = path.with_name(path.name + ".new")
    calbin.write(str(new), calbin.default_spec(seed=seed))
    os.replace(new, path)


def _recover_from_a_fault(ex) -> Status:
    """``ex``'s recovery from a device fault (a CCU exception), as the fault controller
    starts one: what restores the calbin that served."""
    return ex.recover(Status.failure("device.ccu_exception", Category.DEVICE, Phase.RECOVERY,
                                     "a test's fault"))


def test_a_refused_reload_of_the_serving_path_rolls_back_to_the_file_that_served(tmp_path):
    ex = started_executor(tmp_path)
    try:
        path = tmp_path / "synthetic.calbin"
        served = ex.gen.sha256
        _replace_by_rename(path, OTHER_SEED)
        status = ex.switch_model(str(path))
        assert status.code == "recovery.rolled_back", status
        assert "golden.unpinned" in status.message and "serves again" in status.message
        assert ex.state == "Ready" and ex.gen.sha256 == served  # the model that served
        # and it keeps serving through a recovery (the path still holds the refused file)
        again = _recover_from_a_fault(ex)
        assert again.ok, again
        assert ex.state == "Ready" and ex.gen.sha256 == served
    finally:
        ex.shutdown(5.0)


def test_a_recovery_restores_what_served_not_what_the_path_holds_since(tmp_path):
    ex = started_executor(tmp_path)
    try:
        served = ex.gen.sha256
        _replace_by_rename(tmp_path / "synthetic.calbin", OTHER_SEED)
        status = _recover_from_a_fault(ex)
        assert status.ok, status
        assert ex.state == "Ready" and ex.gen.sha256 == served
    finally:
        ex.shutdown(5.0)


def test_a_calbin_written_over_in_place_is_not_restored_and_says_why(tmp_path):
    """``cp`` over the serving file leaves nothing of what served: the restore is refused
    (``calbin.changed``, naming what to do), not served as if it were the same model."""
    ex = started_executor(tmp_path)
    try:
        path = tmp_path / "synthetic.calbin"
        calbin.write(str(path), calbin.default_spec(seed=OTHER_SEED))  # (the same inode)
        status = _recover_from_a_fault(ex)
        assert not status.ok and status.code == "calbin.changed", status
        assert "written over in place" in status.message and "(mv)" in status.message
        assert ex.state == "Failed"
    finally:
        ex.shutdown(5.0)


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_served_files_hold_at_most_the_newest_few_and_close(tmp_path):
    before = _open_fds()
    files = ServedFiles()
    paths = []
    for i in range(HELD_MAX + 3):
        path = tmp_path / f"m{i}.calbin"
        path.write_bytes(b"x%d" % i)
        paths.append(str(path))
        files.served(str(path), f"sha{i}")
    assert files.held() == tuple(paths[-HELD_MAX:])
    assert _open_fds() == before + HELD_MAX
    files.served(paths[-1], f"sha{HELD_MAX + 2}")  # the same: kept, not reopened
    assert _open_fds() == before + HELD_MAX
    # a path renamed over: its restore is the file held; an evicted one, its path
    os.replace(tmp_path / "m0.calbin", paths[-1])
    source, sha = files.source(paths[-1])
    assert source.startswith("/proc/self/fd/") and sha == f"sha{HELD_MAX + 2}"
    assert Path(source).read_bytes() == b"x%d" % (HELD_MAX + 2)
    assert files.source(paths[0]) == (paths[0], "sha0")
    files.close()
    assert _open_fds() == before and files.held() == ()


def test_a_refused_switch_rolls_back_to_a_calbin_removed_since_it_served(tmp_path):
    """Until stop 73 a refused switch whose last good calbin had been removed had nothing
    to load and ended Failed (test_recovery.py's lifecycle scenarios relied on it): the file
    that served is held open and restored."""
    ex = started_executor(tmp_path)
    try:
        served = ex.gen.sha256
        os.remove(tmp_path / "synthetic.calbin")
        other = tmp_path / "other.calbin"
        calbin.write(str(other), calbin.default_spec(seed=OTHER_SEED))
        status = ex.switch_model(str(other))
        assert status.code == "recovery.rolled_back", status
        assert ex.state == "Ready" and ex.gen.sha256 == served
    finally:
        ex.shutdown(5.0)
