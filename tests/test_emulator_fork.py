"""The bundled emulator across ``fork()``: a child forked while another thread of the parent
was inside a CalRT call (every call resolves its handles under the emulator's registry lock)
inherited that lock held by a thread the child does not have, and its first device open hung
for good (CI: an executor built in a forked child, tests/test_embedding_probe64.py, stood
still until the run was killed). The fork now takes the registry first (``pthread_atfork``)."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import pytest

from calexec.drivers.calrt.runtime import CalRT

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="fork() and the emulator's "
                                "pthread_atfork are tested on Linux")

FORKS = 200
HAMMERS = 4
CHILD_BOUND_S = 20.0  # only a bound against a hung child: a child that opens a device ends at once


def _child_ends(pid: int) -> bool:
    """Whether the child ended within the bound (it is killed otherwise); its exit status 0."""
    end = time.monotonic() + CHILD_BOUND_S
    while time.monotonic() < end:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status) == 0
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return False


def test_a_child_forked_during_another_threads_calrt_call_opens_its_own_device():
    rt = CalRT.load()
    rc, device = rt.open_device("")
    assert rc == 0 and device is not None and device.emu is not None
    emu = device.emu
    stop = threading.Event()
    calls = [0]

    def hammer() -> None:  # CalRT calls that hold the registry, the GIL let go in each
        while not stop.is_set() and calls[0] < 50_000_000:
            emu.counters()
            calls[0] += 1

    workers = [threading.Thread(target=hammer, name=f"hammer-{i}", daemon=True)
               for i in range(HAMMERS)]  # (several: one waits for the device under the registry)
    for worker in workers:
        worker.start()
    hung = 0
    try:
        for _ in range(FORKS):
            pid = os.fork()
            if pid == 0:  # pragma: no cover - the child: open a device of its own, then leave
                code = 1
                try:
                    rc_child, own = rt.open_device("")
                    if rc_child == 0 and own is not None:
                        own.close()
                        code = 0
                finally:  # never back into pytest: no teardown, no exit handler runs here
                    os.execv(sys.executable, [sys.executable, "-c", f"raise SystemExit({code})"])
            if not _child_ends(pid):
                hung += 1
                break  # (one is the defect; the rest would each wait the bound)
    finally:
        stop.set()
        for worker in workers:
            worker.join(10.0)
        device.close()
    assert calls[0] > 0
    assert hung == 0, "a child forked during a CalRT call did not open a device"
