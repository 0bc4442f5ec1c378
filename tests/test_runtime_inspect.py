"""``CalRT.inspect_calbin``: the check ``DeviceExecutor.check_calbin`` runs before a model
switch reads a calbin with the runtime's own loader on a scratch device, so it answers what
the switch's load would, and the serving device (its calbin, faults, counters) is untouched."""

from __future__ import annotations

from calexec.drivers.calrt.runtime import CalRT, Fault, FaultMode
from calexec.drivers.synthetic import calbin as cb


def test_inspecting_a_calbin_leaves_the_serving_device_untouched(tmp_path):
    good = tmp_path / "good.calbin"
    good.write_bytes(cb.dumps(cb.default_spec()))
    data = good.read_bytes()
    truncated = tmp_path / "truncated.calbin"
    truncated.write_bytes(data[:len(data) // 2])
    garbage = tmp_path / "garbage.calbin"
    garbage.write_bytes(b"\x7fELF" + b"\0" * 64)
    rt = CalRT.load()
    rc, device = rt.open_device("")
    assert rc == 0 and device is not None and device.emu is not None
    try:
        rc, calbin = device.load_calbin(str(good))
        assert calbin is not None
        rc, models = calbin.models()
        serving = tuple(m.info for m in models)
        device.emu.set_fault(Fault.MAP_FAIL, FaultMode.NTH, 1)
        counters = device.emu.counters()
        stats = device.emu.fault_stats(Fault.MAP_FAIL)

        assert rt.inspect_calbin(str(good)) == serving
        for bad in (truncated, garbage):
            why = rt.inspect_calbin(str(bad))
            assert isinstance(why, str) and why.startswith("the loader refused it ("), why
            rc, refused = device.load_calbin(str(bad))  # the switch's load says the same
            assert refused is None and rc != 0

        assert device.emu.fault_stats(Fault.MAP_FAIL) == stats
        assert device.emu.counters() == counters
        assert calbin.models()[0] == 0  # the serving calbin still answers
        calbin.unload()
    finally:
        device.close()
