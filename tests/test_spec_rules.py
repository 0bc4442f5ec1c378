"""Spec rules issue 18 found approximated: §10.2 unlisted models refuse Ready, FI01 never
configures, §9.2 goldens are pinned per calbin sha256 (no trust on first use unless the
operator says so)."""

from __future__ import annotations

import collections
import logging
import shutil

import attrs
import pytest

from calexec.contracts import goldens as gl
from calexec.contracts.manifest import ManifestError, default_manifest_path, load_manifest
from calexec.drivers.calrt.runtime import CalRT
from calexec.drivers.synthetic import calbin as cb
from calexec.drivers.tools import golden as golden_cli
from calexec.machines.executor import DeviceExecutor, ExecutorConfig
from executor_harness import SEED, oracle_golden, write_calbin
from test_phase_b import TaskTypes

OTHER_SEED = SEED ^ 0x5EED


class CountingDevice:
    """The runtime device with every method call counted (``calls[name]``)."""

    def __init__(self, device, calls: collections.Counter) -> None:
        self._device, self._calls = device, calls

    def __getattr__(self, name):
        attr = getattr(self._device, name)
        if not callable(attr):
            return attr

        def counted(*args, **kwargs):
            self._calls[name] += 1
            return attr(*args, **kwargs)
        return counted


class CountingRuntime:
    """``CalRT`` whose devices count their calls (FI01: configure must never be reached)."""

    def __init__(self) -> None:
        self._rt = CalRT.load()
        self.calls: collections.Counter = collections.Counter()

    def __getattr__(self, name):
        return getattr(self._rt, name)

    def open_device(self, config: str = ""):
        rc, device = self._rt.open_device(config)
        return rc, (None if device is None else CountingDevice(device, self.calls))


@pytest.fixture(scope="module")
def calbins(tmp_path_factory):
    directory = tmp_path_factory.mktemp("spec_rules")
    main = write_calbin(directory)
    other = str(directory / "other.calbin")
    other_sha = cb.write(other, cb.default_spec(seed=OTHER_SEED))
    return {"main": main, "other": other, "other_sha": other_sha}


def start(calbin, manifest=None, runtime=None, **config):
    ex = DeviceExecutor(runtime or CalRT.load(), manifest or load_manifest(default_manifest_path()),
                        ExecutorConfig(calbin_path=calbin, **config))
    return ex, ex.start()


# ---- FI01 and §10.2 at the executor: refused before configure --------------------------------
def renamed(manifest, old, new):
    return attrs.evolve(manifest, submodels={
        kind: attrs.evolve(s, exact_name=s.exact_name.replace(old, new))
        for kind, s in manifest.submodels.items()})


def test_fi01_manifest_mismatch_never_calls_configure(calbins):
    runtime = CountingRuntime()
    manifest = renamed(load_manifest(default_manifest_path()), "decode_s40960_b1", "decode_s40960_b2")
    ex, status = start(calbins["main"], manifest, runtime)
    assert status.code == "manifest.model_missing" and "qwen3_decode_s40960_b2" in status.message
    assert ex.state == "Failed"
    assert runtime.calls["load_calbin"] == 1  # it got as far as the models
    assert runtime.calls["configure"] == 0
    assert runtime.calls["create_kv"] == 0 and runtime.calls["reset_configuration"] == 0


def test_counting_runtime_sees_configure_when_the_manifest_matches(calbins):
    """Control for the test above: the wrapper does count configure on the normal path."""
    runtime = CountingRuntime()
    ex, status = start(calbins["main"], runtime=runtime)
    try:
        assert status.ok and runtime.calls["configure"] == 1
    finally:
        ex.shutdown(5.0)


def test_unlisted_runtime_model_refuses_ready_before_configure(calbins):
    runtime = CountingRuntime()
    manifest = attrs.evolve(load_manifest(default_manifest_path()), ignored_models=())
    ex, status = start(calbins["main"], manifest, runtime)
    assert status.code == "manifest.model_unlisted" and ex.state == "Failed"
    assert "qwen3_decode_s40960_b1_draft" in status.message
    assert runtime.calls["configure"] == 0


# ---- §9.2 pinned goldens ---------------------------------------------------------------------
def test_packaged_golden_pins_the_default_calbin_to_the_oracle(calbins):
    manifest = load_manifest(default_manifest_path())
    sha = cb.write(calbins["main"] + ".again", cb.default_spec())
    pinned = gl.lookup(manifest.goldens, sha, ExecutorConfig(calbin_path="").golden_tokens, 2)
    assert pinned is not None and pinned.tokens == oracle_golden(SEED)
    ex, status = start(calbins["main"])
    try:
        assert status.ok and ex.snapshot()["golden"] == "pinned"
        assert ex.snapshot()["allow_unpinned_golden"] is False
    finally:
        ex.shutdown(5.0)


def test_start_on_an_unpinned_calbin_is_refused_before_the_golden_runs(calbins):
    runtime = CountingRuntime()
    ex, status = start(calbins["other"], runtime=runtime)
    assert status.code == "golden.unpinned" and ex.state == "Failed"
    assert calbins["other_sha"] in status.message and "calexec golden record" in status.message
    assert runtime.calls["infer"] == 0  # refused before anything ran on the device


def test_allow_unpinned_golden_is_explicit_logged_and_visible(calbins, caplog):
    with caplog.at_level(logging.WARNING, logger="calexec.executor"):
        ex, status = start(calbins["other"], allow_unpinned_golden=True)
    try:
        assert status.ok and ex.state == "Ready"
        snap = ex.snapshot()
        assert snap["golden"] == "unpinned" and snap["allow_unpinned_golden"] is True
        assert any("allow_unpinned_golden" in r.getMessage() and calbins["other_sha"] in
                   r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
        # the trusted tokens are the real ones, and a later rebuild is held to them
        assert ex.goldens[calbins["other_sha"]] == oracle_golden(OTHER_SEED)
    finally:
        ex.shutdown(5.0)


def test_switch_to_an_unpinned_calbin_is_refused_and_rolls_back(calbins):
    ex, status = start(calbins["main"])
    try:
        assert status.ok
        refused = ex.switch_model(calbins["other"])
        assert refused.code == "recovery.rolled_back" and "golden.unpinned" in refused.message
        assert ex.state == "Ready" and ex.gen.calbin_path == calbins["main"]
        assert ex.snapshot()["golden"] == "pinned"
    finally:
        ex.shutdown(5.0)
    ex, status = start(calbins["main"], allow_unpinned_golden=True)
    try:
        assert ex.switch_model(calbins["other"]).ok and ex.gen.calbin_path == calbins["other"]
        assert ex.snapshot()["golden"] == "unpinned"
    finally:
        ex.shutdown(5.0)


def copied_manifest(tmp_path):
    path = tmp_path / "m.toml"
    shutil.copy(default_manifest_path(), path)
    return path


def test_golden_record_pins_next_to_the_manifest_and_start_uses_it(calbins, tmp_path, capsys):
    manifest_path = copied_manifest(tmp_path)
    argv = ["golden", "record", "--calbin", calbins["other"], "--manifest", str(manifest_path)]
    assert golden_cli.main(argv) == 0
    written = tmp_path / "m.goldens.toml"
    assert str(written) in capsys.readouterr().out
    manifest = load_manifest(manifest_path)
    (pinned,) = manifest.goldens[calbins["other_sha"]]
    assert pinned.tokens == oracle_golden(OTHER_SEED) and pinned.decode_steps == 2
    assert golden_cli.main(argv) == 0  # recording again replaces, never duplicates
    assert len(load_manifest(manifest_path).goldens[calbins["other_sha"]]) == 1
    ex, status = start(calbins["other"], manifest)
    try:
        assert status.ok and ex.snapshot()["golden"] == "pinned"
    finally:
        ex.shutdown(5.0)


def test_a_pinned_golden_the_calbin_does_not_meet_refuses_it(calbins, tmp_path):
    manifest_path = copied_manifest(tmp_path)
    gl.pin(gl.goldens_path(manifest_path),
           gl.PinnedGolden(calbins["other_sha"], ExecutorConfig(calbin_path="").golden_tokens, 2,
                           (1, 2, 3)))
    ex, status = start(calbins["other"], load_manifest(manifest_path))
    assert status.code == "golden.mismatch" and ex.state == "Failed"


def test_a_golden_for_another_prompt_does_not_count_as_pinned(calbins):
    ex, status = start(calbins["main"], golden_tokens=(3, 1, 4, 1, 5))
    assert status.code == "golden.unpinned"


@pytest.mark.parametrize(("text", "key", "problem"), [
    ("format = 2\n", "format", "must be 1"),
    ("format = 1\nextra = 1\n", "extra", "unknown key"),
    ('format = 1\n[[golden]]\ncalbin_sha256 = "ab"\nprompt = [1]\ndecode_steps = 0\ntokens = [1]\n',
     "golden[0].calbin_sha256", "64 lower-case hex"),
    (f'format = 1\n[[golden]]\ncalbin_sha256 = "{"a" * 64}"\nprompt = [1]\ndecode_steps = 2\n'
     'tokens = [1]\n', "golden[0].tokens", "decode_steps + 1 = 3"),
    (f'format = 1\n[[golden]]\ncalbin_sha256 = "{"a" * 64}"\nprompt = []\ndecode_steps = 0\n'
     'tokens = [1]\n', "golden[0].prompt", "non-empty list"),
    (f'format = 1\n[[golden]]\ncalbin_sha256 = "{"a" * 64}"\nprompt = [1]\ndecode_steps = 0\n'
     'tokens = [1]\nwho = "me"\n', "golden[0].who", "unknown key"),
])
def test_malformed_goldens_file_names_the_key(tmp_path, text, key, problem):
    manifest_path = copied_manifest(tmp_path)
    gl.goldens_path(manifest_path).write_text(text)
    with pytest.raises(ManifestError) as info:
        load_manifest(manifest_path)
    assert info.value.key == key and problem in str(info.value)
    assert str(gl.goldens_path(manifest_path)) in str(info.value)


def test_goldens_round_trip_through_the_writer(tmp_path):
    path = tmp_path / "g.toml"
    a = gl.PinnedGolden("a" * 64, (1, 2), 1, (5, 6), 'note with "quotes" \\ and ünïcode')
    b = gl.PinnedGolden("a" * 64, (3,), 0, (7,))
    gl.pin(path, a)
    assert gl.pin(path, b) == gl.load_goldens(path)
    assert gl.load_goldens(path)["a" * 64] == (a, b)


def test_pinning_through_a_symlinked_goldens_file_keeps_the_link_and_the_mode(tmp_path):
    """A goldens file kept elsewhere and linked in (a deployment's shared file): ``pin``
    replaced the link with a file of its own, so the shared file never saw the golden. It
    now replaces the file the link points to, whole, keeping its mode."""
    shared = tmp_path / "shared" / "g.toml"
    shared.parent.mkdir()
    first = gl.PinnedGolden("a" * 64, (1, 2), 1, (5, 6))
    gl.pin(shared, first)
    shared.chmod(0o640)
    link = tmp_path / "g.toml"
    link.symlink_to(shared)
    second = gl.PinnedGolden("b" * 64, (3,), 0, (7,))
    gl.pin(link, second)
    assert link.is_symlink() and link.resolve() == shared.resolve()
    assert gl.load_goldens(shared) == {"a" * 64: (first,), "b" * 64: (second,)}
    assert shared.stat().st_mode & 0o777 == 0o640
    assert sorted(p.name for p in shared.parent.iterdir()) == ["g.toml"]  # no scratch left


# ---- §8 PROGRAMMING: the feature is really off until the next generation ----------------------
class EngineCalls(TaskTypes):
    """Records which submit path each infer took: "infer" or "fixed" (the fixed task type)."""

    def infer_with_fixed_task_type(self, *args):
        self.calls.append("fixed")
        return self._device.infer_with_fixed_task_type(*args)


def test_programming_fault_switches_the_fixed_engine_path_off_until_generation_plus_one(calbins):
    from fastapi.testclient import TestClient

    from calexec.contracts.errors import Category
    from calexec.contracts.status import Status
    from calexec.drivers.serving.server import ServerConfig, create_app
    from executor_harness import arm, deadline, prefill, running_executor
    from test_server_support import metric_value

    with running_executor(calbins["main"], inflight_capacity=2) as ex:
        ex.device = engines = EngineCalls(ex.device)
        assert not isinstance(ex.enqueue(prefill(1, [1, 2])).wait_until(deadline()), Status)
        assert engines.calls == ["fixed"] and ex.snapshot()["disabled_features"] == []
        arm(ex, "SUBMIT_RC", rc=27)  # CalRT "unsupported" from infer_with_fixed_task_type
        failed = ex.enqueue(prefill(2, [1, 2])).wait_until(deadline())
        assert isinstance(failed, Status) and failed.category is Category.PROGRAMMING
        snap = ex.snapshot()
        assert snap["disabled_features"] == ["fixed_engine"] and snap["inflight_capacity"] == 1
        assert snap["generation"] == 1 and snap["lifecycle"] == "Ready"  # no reset, no rebuild
        with TestClient(create_app(ex, ServerConfig())) as client:
            text = client.get("/metrics").text
        assert metric_value(text, "calexec_feature_disabled", {"feature": "fixed_engine"}) == 1
        engines.calls.clear()
        assert not isinstance(ex.enqueue(prefill(3, [1, 2])).wait_until(deadline()), Status)
        assert engines.calls == ["infer"]  # the plain path serves meanwhile
        # generation+1 switches it on again
        assert ex.switch_model(calbins["main"]).ok and ex.gen.id == 2
        snap = ex.snapshot()
        assert snap["disabled_features"] == [] and snap["inflight_capacity"] == 2
        engines.calls.clear()
        assert not isinstance(ex.enqueue(prefill(4, [1, 2])).wait_until(deadline()), Status)
        assert engines.calls == ["fixed"]


def test_programming_fault_on_a_mandatory_path_switches_nothing_off(calbins):
    from calexec.contracts.status import Status
    from executor_harness import arm, deadline, prefill, running_executor

    with running_executor(calbins["main"]) as ex:  # Phase A: plain infer is the only path
        arm(ex, "SUBMIT_RC", rc=27)
        assert isinstance(ex.enqueue(prefill(1, [1, 2])).wait_until(deadline()), Status)
        assert ex.snapshot()["disabled_features"] == [] and ex.snapshot()["inflight_capacity"] == 1
        assert not isinstance(ex.enqueue(prefill(2, [1, 2])).wait_until(deadline()), Status)


def test_golden_record_usage_errors_name_the_problem(calbins, tmp_path, capsys):
    missing = str(tmp_path / "nope.calbin")
    assert golden_cli.main(["golden", "record", "--calbin", missing]) == 2
    assert "nope.calbin" in capsys.readouterr().err
    bad_manifest = tmp_path / "bad.toml"
    bad_manifest.write_text('name = "x"\n')
    assert golden_cli.main(["golden", "record", "--calbin", calbins["main"],
                            "--manifest", str(bad_manifest)]) == 2
    assert "bad.toml" in capsys.readouterr().err
    # a calbin the manifest refuses: nothing is pinned
    manifest_path = copied_manifest(tmp_path)
    text = manifest_path.read_text().replace('ignored_models = ["qwen3_decode_s40960_b1_draft"]\n', "")
    manifest_path.write_text(text)
    assert golden_cli.main(["golden", "record", "--calbin", calbins["main"],
                            "--manifest", str(manifest_path)]) == 3  # runtime refusal
    assert "manifest.model_unlisted" in capsys.readouterr().err
    assert not gl.goldens_path(manifest_path).exists()
