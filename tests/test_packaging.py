"""Packaging as a library: the wheel holds every subpackage and data file; the core's
dependencies are ranges without the server/plot stack; every pin lives in constraints.txt and
satisfies the ranges.

The wheel is built with ``pip wheel --no-deps --no-build-isolation`` (offline: setuptools,
wheel, cffi and numpy are already installed by the [test] extra)."""

from __future__ import annotations

import email.parser
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
LAYERS = {"calexec": "calexec", "calexec/contracts": "contracts",
          "calexec/machines": "machines", "calexec/drivers": "drivers"}
SERVER_AND_PLOTS = {"fastapi", "uvicorn", "prometheus-client", "matplotlib", "ray", "tqdm"}


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def source_files() -> set[str]:
    """Every file the wheel must hold, as its path inside the wheel: each package's .py files
    (a package is a folder with __init__.py under a layer) and the data files."""
    want: set[str] = set()
    for prefix, folder in LAYERS.items():
        base = ROOT / folder
        for init in base.rglob("__init__.py"):
            pkg = init.parent
            if "__pycache__" in pkg.parts or any(p.startswith(".") for p in pkg.relative_to(ROOT).parts):
                continue
            rel = pkg.relative_to(base).as_posix()
            dest = prefix if rel == "." else f"{prefix}/{rel}"
            want |= {f"{dest}/{py.name}" for py in pkg.glob("*.py")}
    # every file the package-data globs of pyproject.toml match
    for package, globs in pyproject()["tool"]["setuptools"]["package-data"].items():
        parts = package.split(".")
        folder = ROOT / LAYERS["/".join(parts[:2])] / "/".join(parts[2:])
        dest = "/".join(parts)
        for pattern in globs:
            want |= {f"{dest}/{f.relative_to(folder).as_posix()}" for f in folder.glob(pattern)}
    return want


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    # a clean copy of the sources: setuptools would reuse a stale build/ of the work tree
    src = tmp_path_factory.mktemp("src") / "calexec"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", ".venv*", "build", "dist", "*.egg-info", "__pycache__", "*.so", "out",
        ".pytest_cache", ".hypothesis"))
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                            "--no-build-isolation", "-q", "-w", str(out), str(src)],
                           capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-3000:]
    wheels = list(out.glob("calexec-*.whl"))
    assert len(wheels) == 1, wheels
    with zipfile.ZipFile(wheels[0]) as zf:
        yield zf


def test_the_wheel_holds_every_subpackage_and_data_file(wheel):
    names = set(wheel.namelist())
    want = source_files()
    assert "calexec/drivers/tools/conform/runner.py" in want  # a hand list once forgot conform/
    assert {"calexec/drivers/serving/server.py", "calexec/drivers/fleet/edge.py",
            "calexec/drivers/synthetic/oracle.py", "calexec/drivers/calrt/runtime.py"} <= want
    assert {"calexec/contracts/manifests/qwen3_synthetic.toml", "calexec/drivers/calrt/Makefile",
            "calexec/drivers/calrt/calrt.h", "calexec/drivers/calrt/emulator.c"} <= want
    missing = sorted(want - names)
    assert not missing, f"not in the wheel: {missing}"
    # the compiled emulator and allocation counter, and nothing from the tests
    assert any(n.startswith("calexec/drivers/calrt/_calrt_emu") and n.endswith(".so") for n in names)
    for module in ("calexec/drivers/_alloccount", "calexec/drivers/native/_calexec_native"):
        assert any(n.startswith(module) and n.endswith(".so") for n in names), module
    assert not [n for n in names if n.startswith("tests/") or "/tests/" in n]


def test_the_wheel_metadata_keeps_the_core_small(wheel):
    meta_name = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    meta = email.parser.Parser().parsestr(wheel.read(meta_name).decode("utf-8"))
    core = [Requirement(r) for r in meta.get_all("Requires-Dist") if "extra ==" not in r]
    names = {canonicalize_name(r.name) for r in core}
    assert names == {"python-statemachine", "attrs", "numpy", "cffi", "graphviz", "pydot"}, names
    assert not names & SERVER_AND_PLOTS
    for req in core:
        assert req.specifier and not any(s.operator == "==" for s in req.specifier), req
    extras = set(meta.get_all("Provides-Extra"))
    assert {"server", "plots", "ray", "test", "tokenizer", "load"} <= extras
    entry_points = next(n for n in wheel.namelist() if n.endswith("entry_points.txt"))
    assert "calexec = calexec.cli:main" in wheel.read(entry_points).decode()


def test_every_requirement_is_pinned_once_in_constraints_within_its_range():
    pins: dict[str, str] = {}
    for line in (ROOT / "constraints.txt").read_text(encoding="utf-8").splitlines():
        line = line.split("#")[0].strip()
        if line:
            req = Requirement(line)
            name = canonicalize_name(req.name)
            assert name not in pins, f"{name} pinned twice"
            spec = list(req.specifier)
            assert len(spec) == 1 and spec[0].operator == "==", line
            pins[name] = spec[0].version
    project = pyproject()
    reqs = [*project["project"]["dependencies"], *project["build-system"]["requires"]]
    for extra in project["project"]["optional-dependencies"].values():
        reqs += extra
    for text in reqs:
        req = Requirement(text)
        name = canonicalize_name(req.name)
        if name == "calexec":  # an extra pulling another extra
            continue
        assert name in pins, f"{name} has no pin in constraints.txt"
        assert req.specifier.contains(pins[name], prereleases=True), (text, pins[name])
        assert not any(s.operator == "==" for s in req.specifier), f"exact pin outside constraints: {text}"
