"""The server's logits rows are reused (drivers/serving/rows.py; issue 28, the server's share):
a row goes back to the pool only when no array over it is left, so a job still on the device
for an abandoned request keeps its row until it lets go; free rows are bounded and of one
size. Also on a live server: sequential requests reuse one row, and an abandoned request's row
stays out of the pool while its job is held on the stepped device."""

from __future__ import annotations

import gc
import threading

import httpx
import pytest

from calexec.drivers.native.fused_logits import CACHE_ARRAYS
from calexec.drivers.serving.rows import RowPool
from calexec.drivers.serving.server import ServerConfig, create_app
from calexec.drivers.tools.chaos import LiveServer
from test_server_extra import busy_engine, step_one_job
from test_server_support import (
    oracle_tokens,
    server_idle,
    stalled_client,
    started_executor,
    wait_for,
)


def test_a_row_comes_back_when_no_array_over_it_is_left():
    pool = RowPool(4)
    row = pool.take(16)
    assert row.shape == (16,) and row.dtype.name == "float32" and row.flags.writeable
    address = row.ctypes.data
    part = row[3:9]  # a result's slice, a deferred conversion's destination
    del row
    assert pool.counts() == {"lent": 1, "free": 0, "created": 1}  # the slice keeps it out
    other = pool.take(16)
    assert other.ctypes.data != address and pool.counts()["created"] == 2
    part[:] = 7.0  # still its own memory: the other row does not see it
    assert not (other == 7.0).all() or other.ctypes.data != address
    del part
    assert pool.counts() == {"lent": 1, "free": 1, "created": 2}
    again = pool.take(16)
    assert again.ctypes.data == address and pool.counts()["created"] == 2
    del other, again
    assert pool.counts() == {"lent": 0, "free": 2, "created": 2}


def test_free_rows_are_bounded_and_of_one_size():
    pool = RowPool(2)
    rows = [pool.take(8) for _ in range(3)]
    del rows
    assert pool.counts() == {"lent": 0, "free": 2, "created": 3}  # the third was dropped
    kept = pool.take(8)  # held across a "model switch" to another vocabulary
    wider = pool.take(12)
    assert pool.counts() == {"lent": 2, "free": 0, "created": 4}  # size 8's free rows dropped
    del kept  # a row of the old size is not kept
    assert pool.counts() == {"lent": 1, "free": 0, "created": 4}
    del wider
    assert pool.counts() == {"lent": 0, "free": 1, "created": 4}
    with pytest.raises(ValueError, match="count=0"):
        pool.take(0)
    with pytest.raises(ValueError, match="max_free=-1"):
        RowPool(-1)


def test_rows_dropped_on_other_threads_come_back_once_each():
    pool = RowPool(64)
    rows = [pool.take(32) for _ in range(40)]
    start = threading.Barrier(4)

    def drop(mine: list) -> None:
        start.wait(10)
        while mine:
            mine.pop()

    threads = [threading.Thread(target=drop, args=(rows[i::4],)) for i in range(4)]
    del rows
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    gc.collect()
    assert pool.counts() == {"lent": 0, "free": 40, "created": 40}
    taken = [pool.take(32) for _ in range(40)]
    assert len({r.ctypes.data for r in taken}) == 40  # no row handed out twice
    assert pool.counts() == {"lent": 40, "free": 0, "created": 40}


def test_sequential_requests_reuse_rows_and_answer_the_oracle(tmp_path):
    """The fused conversion keeps the pointers of its last ``CACHE_ARRAYS`` destination rows
    (holding them: those stay lent); past that, requests take rows that came back. Before
    the pool every request allocated one (created == requests)."""
    executor = started_executor(tmp_path)
    app = create_app(executor, ServerConfig())
    requests = 3 * CACHE_ARRAYS
    try:
        with LiveServer(app) as server, httpx.Client(base_url=server.url, timeout=20) as client:
            for i in range(requests):
                prompt = [5 + i % 3, 6, 7]
                got = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4})
                assert got.status_code == 200, got.text
                assert got.json()["choices"][0]["token_ids"] == oracle_tokens(prompt, 4)
            service = app.state.service
            wait_for(lambda: server_idle(service), what="the server idle")
            counts = service.rows.counts()
        assert counts["created"] <= CACHE_ARRAYS + 2 < requests, counts
        assert counts["lent"] <= CACHE_ARRAYS, counts
    finally:
        executor.shutdown(5.0)


def test_an_abandoned_requests_row_stays_out_while_its_job_is_on_the_device(tmp_path):
    executor = started_executor(tmp_path)
    emu = executor.device.emu
    app = create_app(executor, ServerConfig(max_resumes=0))
    service = app.state.service
    try:
        with LiveServer(app) as server:
            assert emu.set_stepped(True) == 0  # every job waits on the device for this test
            sock = stalled_client(server.port, {"prompt": [5, 6, 7], "max_tokens": 4})
            wait_for(lambda: busy_engine(emu) is not None, what="the prefill on the device")
            assert service.rows.counts()["lent"] == 1
            sock.close()  # the client leaves; its job stays on the device
            wait_for(lambda: service.active == 0, what="the abandoned request to end")
            assert busy_engine(emu) is not None  # the job is still there ...
            # ... and so the row it writes into is not free for another request
            assert service.rows.counts() == {"lent": 1, "free": 0, "created": 1}
            step_one_job(emu)  # the device finishes the job
            assert emu.set_stepped(False) == 0
            wait_for(lambda: server_idle(service), what="the server idle")
            with httpx.Client(base_url=server.url, timeout=20) as client:
                got = client.post("/v1/completions", json={"prompt": [9, 1], "max_tokens": 3})
            assert got.status_code == 200
            assert got.json()["choices"][0]["token_ids"] == oracle_tokens([9, 1], 3)
    finally:
        emu.set_stepped(False)
        executor.shutdown(5.0)



def test_a_row_held_by_a_reference_cycle_comes_back_when_the_cycle_is_collected():
    pool = RowPool(4)

    class Cycle:
        pass

    holder = Cycle()
    holder.me = holder  # only the collector frees it
    holder.row = pool.take(8)[2:]
    gc.disable()
    try:
        del holder
        assert pool.counts() == {"lent": 1, "free": 0, "created": 1}
        gc.collect()
        assert pool.counts() == {"lent": 0, "free": 1, "created": 1}
    finally:
        gc.enable()
