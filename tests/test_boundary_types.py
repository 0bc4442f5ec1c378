"""No ``Any`` at a layer boundary (docs/testing.md "Lint and types"; stop 54).

The public API of ``calexec.contracts`` and ``calexec.machines`` is what drivers/, tools and an
embedder's own server call: every public module function, every public method, property and
annotated attribute of a public class (``self.x: T`` set in a method included) must name its
types. ``typing.Any`` there switches mypy off for every caller (an embedder's ``mypy
--strict`` too): a wrong record key or a missing ``None`` check then surfaces at run time.

Private names (``_x``) may keep ``Any``, and so do attrs validator callbacks
``(instance, attribute, value)`` (attrs' own signature). What must stay ``Any`` is listed in
``ALLOWED`` below, each with its reason; an entry that no longer matches fails too, so the
list only shrinks.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import re
import sys
import types
import typing
from collections.abc import Callable, Iterator
from pathlib import Path

from statemachine import StateChart

import calexec.contracts
import calexec.machines
from calexec.contracts.status import Phase, Status

PACKAGES = (calexec.contracts, calexec.machines)

HANDLE = "a handle the runtime made, passed back to it (contravariance: device_api.py)"

#: "module:qualname" or "module:qualname(param)" -> why Any stays there
ALLOWED: dict[str, str] = {
    # attrs validator factories return an attrs validator ``(instance, attribute, value)``:
    # attrs' own callback type (``attribute`` an ``attrs.Attribute[T]`` of each field's T)
    "calexec.contracts.fields:flag(return)": "an attrs validator callback, attrs' signature",
    "calexec.contracts.fields:number(return)": "an attrs validator callback, attrs' signature",
    # the runtime's own handles passed back to it (machines/device_api.py module docstring):
    # a protocol's parameters are contravariant, and each runtime takes only its own handle
    # classes there (the cffi driver's Device.infer takes its Model, not any ModelApi)
    "calexec.machines.device_api:DeviceApi.configure(calbin)": HANDLE,
    "calexec.machines.device_api:DeviceApi.create_kv(calbin)": HANDLE,
    "calexec.machines.device_api:DeviceApi.infer(model)": HANDLE,
    "calexec.machines.device_api:DeviceApi.infer(kv)": HANDLE,
    "calexec.machines.device_api:DeviceApi.infer(inbuf)": HANDLE,
    "calexec.machines.device_api:DeviceApi.infer(outbuf)": HANDLE,
    "calexec.machines.device_api:DeviceApi.infer_with_fixed_task_type(model)": HANDLE,
    "calexec.machines.device_api:DeviceApi.infer_with_fixed_task_type(kv)": HANDLE,
    "calexec.machines.device_api:DeviceApi.infer_with_fixed_task_type(inbuf)": HANDLE,
    "calexec.machines.device_api:DeviceApi.infer_with_fixed_task_type(outbuf)": HANDLE,
    "calexec.machines.device_api:SubmitRelay.fire(device)": HANDLE,
    "calexec.machines.device_api:SubmitRelay.fire(model)": HANDLE,
    "calexec.machines.device_api:SubmitRelay.fire(kv)": HANDLE,
    "calexec.machines.device_api:SubmitRelay.fire(inbuf)": HANDLE,
    "calexec.machines.device_api:SubmitRelay.fire(outbuf)": HANDLE,
}

#: the parameter names of an attrs validator callback (attrs' signature: may keep Any)
VALIDATOR_PARAMS = ("instance", "attribute", "value")


def _modules() -> Iterator[types.ModuleType]:
    for package in PACKAGES:
        yield package
        for info in pkgutil.iter_modules(package.__path__, package.__name__ + "."):
            yield importlib.import_module(info.name)


def _public(name: str) -> bool:
    return not name.startswith("_") or (name.startswith("__") and name.endswith("__")
                                        and name in ("__init__", "__call__"))


def _namespace() -> dict[str, object]:
    """Every name of every module of the two layers: the annotations name classes imported
    under ``TYPE_CHECKING`` only, which are calexec's own; a module's own globals win."""
    names: dict[str, object] = {}
    for module in _modules():
        for name, value in vars(module).items():
            if not name.startswith("__"):
                names.setdefault(name, value)
    return names


def _has_any(tp: object, depth: int = 0) -> bool:
    if tp is typing.Any:
        return True
    if depth > 20:
        return False
    if isinstance(tp, (list, tuple)):  # ``Callable[[A, B], R]``'s parameters come as a list
        return any(_has_any(arg, depth + 1) for arg in tp)
    origin = typing.get_origin(tp)
    if isinstance(origin, type) and issubclass(origin, StateChart):
        # python-statemachine's StateChart is generic in its model (``StateChart[TModel]``);
        # a user's chart class is ``StateChart[Any]`` unless it says otherwise, and the chart
        # toolkit takes any chart class (``compiled.ChartLike``). ``Any`` there is the type
        # of the user's model, which calexec only hands back to the chart.
        return False
    return any(_has_any(arg, depth + 1) for arg in typing.get_args(tp))


def _any_in(annotation: object, globalns: dict[str, object]) -> bool:
    if not isinstance(annotation, str):
        return _has_any(annotation)
    try:
        resolved = eval(annotation, globalns)  # noqa: S307 - the module's own annotation text
    except Exception:  # noqa: BLE001 - a name not importable here: read the text instead
        return re.search(r"\bAny\b", annotation) is not None
    return _has_any(resolved)


def _function_findings(where: str, fn: object, globalns: dict[str, object]) -> Iterator[str]:
    annotations = inspect.get_annotations(fn)  # type: ignore[arg-type]
    params = [p for p in annotations if p != "return"]
    validator = tuple(params) == VALIDATOR_PARAMS
    for name, annotation in annotations.items():
        if validator and name != "return":
            continue
        if _any_in(annotation, globalns):
            yield f"{where}({name})"


def _self_attributes(cls: type) -> Iterator[tuple[str, str]]:
    """``self.name: annotation`` in the class's own methods (source text)."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return
    tree = ast.parse(inspect.cleandoc("\n" + source) if source.startswith((" ", "\t"))
                     else source)
    for node in ast.walk(tree):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Attribute)
                and isinstance(node.target.value, ast.Name) and node.target.value.id == "self"
                and _public(node.target.attr)):
            yield node.target.attr, ast.unparse(node.annotation)


def _findings() -> list[str]:
    shared = _namespace()
    found: list[str] = []
    for module in _modules():
        globalns = {**shared, **vars(module)}
        for name, obj in vars(module).items():
            if not _public(name) or getattr(obj, "__module__", None) != module.__name__:
                continue
            where = f"{module.__name__}:{name}"
            if inspect.isfunction(obj):
                found.extend(_function_findings(where, obj, globalns))
            elif inspect.isclass(obj):
                for attr, annotation in inspect.get_annotations(obj).items():
                    if _public(attr) and _any_in(annotation, globalns):
                        found.append(f"{where}.{attr}")
                for attr, annotation in _self_attributes(obj):
                    if _any_in(annotation, globalns):
                        found.append(f"{where}.{attr}")
                for attr, member in vars(obj).items():
                    if not _public(attr):
                        continue
                    if isinstance(member, (staticmethod, classmethod)):
                        member = member.__func__
                    if isinstance(member, property):
                        member = member.fget
                    if inspect.isfunction(member):
                        found.extend(_function_findings(f"{where}.{attr}", member, globalns))
        # module-level public annotated names (constants, aliases given a type)
        for name, annotation in inspect.get_annotations(module).items():
            if _public(name) and _any_in(annotation, globalns):
                found.append(f"{module.__name__}:{name}")
    return sorted(set(found))


def _allowed(finding: str) -> bool:
    return finding in ALLOWED or finding.split("(")[0] in ALLOWED


def test_no_any_in_a_public_signature_of_contracts_or_machines() -> None:
    """Every public signature and attribute of the two inner layers names its types; an
    ``Any`` left there names the module, qualname and parameter."""
    offending = [f for f in _findings() if not _allowed(f)]
    assert not offending, ("typing.Any at a layer boundary (type it, or allowlist it in "
                           "tests/test_boundary_types.py with the reason):\n  "
                           + "\n  ".join(offending))


def test_the_allowlist_names_only_what_still_has_any() -> None:
    """An allowlist entry whose signature lost its ``Any`` is removed, not kept."""
    findings = _findings()
    stale = [key for key in ALLOWED
             if not any(f == key or f.split("(")[0] == key for f in findings)]
    assert not stale, f"allowlisted but no Any there any more: {stale}"


def test_the_walk_sees_what_it_checks() -> None:
    """The walk itself: it finds the executor's constructor and the Status constructors (a
    walk that saw nothing would pass vacuously)."""
    from calexec.machines.executor import DeviceExecutor

    params = inspect.get_annotations(DeviceExecutor.__init__)
    assert {"runtime", "manifest", "config"} <= set(params)
    assert "calexec.machines.executor" in sys.modules
    assert Path(inspect.getfile(DeviceExecutor)).name == "executor.py"
    assert _any_in("dict[str, Any]", {"Any": typing.Any})
    assert _any_in("Callable[[Any], None]", {"Any": typing.Any, "Callable": Callable})
    assert not _any_in("dict[str, object]", {})


# ---- the records' TypedDicts say what the executor really keeps ------------------------------
def matches_type(value: object, tp: object) -> bool:
    """``value`` is of ``tp`` as far as a JSON-like record goes: unions, None, TypedDicts
    (exactly their keys: the required ones and any optional ones), lists and dicts of them."""
    origin = typing.get_origin(tp)
    if tp is typing.Any or tp is object:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(matches_type(value, option) for option in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if typing.is_typeddict(tp):
        hints = typing.get_type_hints(tp)
        return (isinstance(value, dict)
                and tp.__required_keys__ <= value.keys() <= hints.keys()  # type: ignore[attr-defined]
                and all(matches_type(v, hints[k]) for k, v in value.items()))
    if origin is list:
        (item,) = typing.get_args(tp)
        return isinstance(value, list) and all(matches_type(v, item) for v in value)
    if origin is dict:
        key, item = typing.get_args(tp)
        return isinstance(value, dict) and all(
            matches_type(k, key) and matches_type(v, item) for k, v in value.items())
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, origin or tp)  # type: ignore[arg-type]


def test_the_records_an_executor_keeps_are_their_declared_typeddicts(tmp_path: Path) -> None:
    """``recoveries``, ``job_trail``, ``snapshot()["dispatch"]`` and ``Status.to_dict()`` hold
    exactly what their TypedDicts (machines/api.py, contracts/status.py) declare: a type that
    lied would be worse than the ``Any`` it replaced."""
    from calexec.contracts.status import StatusDict
    from calexec.machines.api import DispatchSnapshot, JobTrail, RecoveryRecord
    from executor_harness import deadline, prefill, running_executor, write_calbin

    calbin = write_calbin(tmp_path)
    with running_executor(calbin) as ex:
        handle = ex.enqueue(prefill(1, [3, 14, 15]))
        handle.wait_until(deadline())
        trail = ex.job_trail(handle.job_id)
        assert trail is not None and trail["trail"], trail
        assert matches_type(trail, JobTrail), trail
        assert ex.switch_model(calbin).ok  # one record, through the recovery path
        (record,) = ex.recoveries
        assert matches_type(record, RecoveryRecord), record
        assert "refused" in record and "reset_kind" in record  # (this path sets both)
        assert matches_type(ex.snapshot()["dispatch"], DispatchSnapshot)
    failure = Status.internal("probe", Phase.CONFIGURE, "a message", job_id=3, raw=7)
    assert matches_type(failure.to_dict(), StatusDict)
    assert matches_type(Status.OK.to_dict(), StatusDict)
    assert not matches_type({"ok": True}, StatusDict)  # the check itself can fail


# ---- what the stricter types revealed -------------------------------------------------------
class _NoDeviceRuntime:
    """A runtime that answers ``open_device`` with 0 and no device (a broken shim)."""

    def open_device(self, config: str = "", /) -> tuple[int, None]:
        return 0, None


def test_a_runtime_that_opens_no_device_fails_start_with_a_status_naming_it() -> None:
    """``open_device`` answering 0 without a device breaks the driver contract; ``start``
    answers ``internal.runtime_no_object`` naming ``open_device``, as it does for every other
    runtime call that makes an object (``device_api.no_object``). It raised
    ``AttributeError: 'NoneType' object has no attribute ...`` inside start, reported as
    ``internal.start_exception`` (found by typing ``DeviceExecutor.device`` ``DeviceApi |
    None``)."""
    from calexec.contracts.manifest import default_manifest_path, load_manifest
    from calexec.machines.executor import DeviceExecutor, ExecutorConfig

    for capacity in (1, 2):  # (Phase B calls the device first: EnableParallelMode)
        ex = DeviceExecutor(_NoDeviceRuntime(), load_manifest(default_manifest_path()),
                            ExecutorConfig(calbin_path="unused.calbin", threads=False,
                                           inflight_capacity=capacity))
        status = ex.start()
        assert status.code == "internal.runtime_no_object", status
        assert "open_device returned 0 but no object" in status.message
        assert ex.state == "Failed"
        assert ex.shutdown(grace=1.0) == status
