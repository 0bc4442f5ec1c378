"""``DeviceExecutor.check_calbin``'s host-side read of a calbin (drivers/calrt/calbin_check.py)
against the emulator's own loader: on seeded mutations of the default calbin, the twin never
refuses a file the C loader accepts, and where both accept it reports the very models
``GetAllModels`` does (so the manifest check before a switch sees what the switch would). It
may let through what the loader refuses (the Qwen3 execution contract): the switch still
refuses that, and rolls back."""

from __future__ import annotations

import random

from calexec.drivers.calrt import calbin_check
from calexec.drivers.calrt.runtime import CalRT
from calexec.drivers.synthetic import calbin as cb


def _mutations(seed: int, count: int):
    lines = cb.dumps(cb.default_spec()).split(b"\n")[:-1]
    rng = random.Random(seed)
    for _ in range(count):
        out = list(lines)
        for _ in range(rng.randint(1, 3)):
            op, k = rng.randrange(7), rng.randrange(len(out))
            if op == 0:
                del out[k]
            elif op == 1:
                out.insert(k, out[rng.randrange(len(out))])
            elif op == 2 and out[k]:
                line = bytearray(out[k])
                line[rng.randrange(len(line))] = rng.choice(b"0123456789 ,-+xAZ\t")
                out[k] = bytes(line)
            elif op == 3:
                out[k] += b" " + rng.choice([b"1", b"x", b"0"])
            elif op == 4:
                out[k] = out[k].replace(b",", b",,", 1)
            elif op == 5:
                out[k] = b" " + out[k]
            else:
                out[k] += b"\t"
        yield b"\n".join(out) + b"\n"


def test_the_host_read_never_refuses_what_the_loader_accepts_and_reports_its_models(tmp_path):
    rc, device = CalRT.load().open_device("")
    assert rc == 0 and device is not None
    path = tmp_path / "mutated.calbin"
    refused_by_both = 0
    try:
        for data in _mutations(seed=38, count=600):
            path.write_bytes(data)
            twin = calbin_check.inspect(data)
            rc, calbin = device.load_calbin(str(path))
            if calbin is None:
                refused_by_both += isinstance(twin, str)
                continue
            rc, models = calbin.models()
            infos = tuple(m.info for m in models)
            calbin.unload()
            assert twin == infos, (data, twin)
    finally:
        device.close()
    assert refused_by_both > 100  # the mutations do reach the refusals


def test_garbage_and_truncation_are_refused_naming_why():
    good = cb.dumps(cb.default_spec())
    assert isinstance(calbin_check.inspect(good), tuple)
    assert "header" in calbin_check.inspect(b"\x7fELF" + b"\0" * 64)
    assert "newline" in calbin_check.inspect(good[:len(good) // 2])
    assert "'end'" in calbin_check.inspect(good[:good.rindex(b"end\n")])
    assert "larger" in calbin_check.inspect(good * 1000)
