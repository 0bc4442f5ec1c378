"""Stop 63's newcomer pass over the docs (README, docs/embedding.md, framework.md, server.md's
quick start, operations.md, deployment.md, testing.md, diagrams.md), each snippet typed as
written in a scratch directory: each test here pins a defect found so, or a claim the other
doc tests did not check.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from calexec.contracts.manifest import default_manifest_path, load_manifest
from calexec.drivers.calrt.runtime import CalRT
from calexec.drivers.device_spec import with_emulated_latency
from calexec.machines.executor import DeviceExecutor, ExecutorConfig
from executor_harness import write_calbin

ROOT = Path(__file__).resolve().parent.parent


def test_a_start_whose_golden_outlasts_golden_timeout_s_names_the_warm_up_and_the_setting(
        tmp_path):
    """docs/embedding.md section 1 as an embedder types it, with an emulated latency in
    ``device_config`` (or a device slower than 10 s per golden job): ``start()`` answered
    ``wait.deadline [deadline/wait] wait_until deadline passed; the job continues (state
    Submitted)``, naming neither the golden warm-up nor ``ExecutorConfig.golden_timeout_s``,
    as if a wait of the caller's had timed out. It names both, and the way out."""
    config = ExecutorConfig(calbin_path=write_calbin(tmp_path),
                            device_config="prefill_per_token_us=60000",  # 17 tokens: ~1 s
                            golden_timeout_s=0.2)
    executor = DeviceExecutor(CalRT.load(), load_manifest(default_manifest_path()), config)
    try:
        status = executor.start()
        assert not status.ok
        assert status.code == "wait.deadline", status  # the code is unchanged
        assert "golden" in status.message, status
        assert "ExecutorConfig.golden_timeout_s=0.2" in status.message, status
        assert "with_emulated_latency" in status.message, status
        assert executor.state == "Failed"
        assert executor.failure is not None and "golden_timeout_s" in executor.failure.message
    finally:
        executor.shutdown(10.0)
    # the way out the message names: the same config through with_emulated_latency starts
    moved = with_emulated_latency(config)
    assert moved.golden_timeout_s > 1.0
    executor = DeviceExecutor(CalRT.load(), load_manifest(default_manifest_path()), moved)
    try:
        assert executor.start().ok
    finally:
        assert executor.shutdown(10.0).ok
