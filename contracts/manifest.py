"""The model manifest (spec §4.1, §10.2): a TOML file, loaded once, resolved against the runtime.

``load_manifest(path)`` parses and validates the file (unknown keys, wrong types, duplicate or
unknown kinds and inconsistent contracts raise :class:`ManifestError` naming the file, the key
and the value). ``Manifest.resolve(models, generation_id, calbin_sha256)`` checks it against
the runtime's ``GetAllModels`` answer and returns a :class:`ModelGeneration` or an ARTIFACT
``Status`` naming the offender; it never raises. Lookup is by EXACT name, never substring
(S08): every manifest name must appear exactly once, and a runtime model the manifest does not
list (neither a submodel nor in ``ignored_models``) refuses the generation (§10.2: missing,
extra or duplicated models all keep it from Ready). Format: docs/manifest.md.
"""

from __future__ import annotations

import collections
import tomllib
import types
from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import attrs

from calexec.contracts.files import read_toml
from calexec.contracts.goldens import (
    NO_GOLDENS,
    GoldenFileError,
    Goldens,
    goldens_path,
    load_goldens,
)
from calexec.contracts.runtime_view import RuntimeModelInfo, RuntimeTensorInfo
from calexec.contracts.status import Status
from calexec.contracts.types import (
    SHA256_RE,
    FieldError,
    ModelGeneration,
    SubmodelContract,
    TaskKind,
    TensorContract,
    validate_submodels,
)

_TOP_KEYS = {"name": str, "calrt_version": str, "calbin_sha256": str, "vocab_size": int, "hidden_size": int,
             "submodel": list, "ignored_models": list}
_TOP_OPTIONAL = {"calbin_sha256", "ignored_models"}
_TENSOR_ROLES = ("token_or_embed", "position", "logits")
_SUB_KEYS = {"kind": str, "exact_name": str, "csr_cur_seq": str, "csr_total_seq": str, "max_batch": int,
             "max_seq": int, "logits_tile_d0": int, **{role: dict for role in _TENSOR_ROLES}}
_TOML_TYPE = {str: "string", int: "integer", bool: "boolean", list: "array", dict: "table"}
_TENSOR_KEYS = {"name": str, "shape": list, "dtype": str, "byte_size": int, "sliceable": bool}
#: Manifest fields that must equal the graph metadata the runtime reports (S09).
META_KEYS = ("logits_tile_d0", "max_seq", "max_batch")


#: ``ManifestError.value`` when the key is absent (or the file does not parse).
ABSENT = object()


class ManifestError(ValueError):
    """A manifest file is malformed. ``key`` is a dotted path such as ``submodel[1].logits.dtype``;
    ``value`` the offending value, or :data:`ABSENT`."""

    def __init__(self, file: str, key: str, value: object, problem: str) -> None:
        self.file, self.key, self.value, self.problem = file, key, value, problem
        shown = "" if value is ABSENT else f"={value!r}"
        super().__init__(f"{file}: {key}{shown}: {problem}")


def _table(file: str, where: str, table: Any, schema: dict[str, type], optional: set[str]) -> dict[str, Any]:
    """Check ``table`` has exactly the schema's keys with the schema's types; return it."""
    if not isinstance(table, dict):
        raise ManifestError(file, where, table, "must be a table")
    for key, value in table.items():
        if key not in schema:
            raise ManifestError(file, f"{where}.{key}" if where else key, value,
                                f"unknown key (allowed: {', '.join(sorted(schema))})")
    for key, kind in schema.items():
        path = f"{where}.{key}" if where else key
        if key not in table:
            if key in optional:
                continue
            raise ManifestError(file, path, ABSENT, "missing required key")
        value = table[key]
        # bool is an int subclass: a boolean is never a valid count, and vice versa.
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ManifestError(file, path, value, f"must be of TOML type {_TOML_TYPE[kind]}")
    return table


def _tensor(file: str, where: str, raw: Any) -> TensorContract:
    table = _table(file, where, raw, _TENSOR_KEYS, set())
    shape = table["shape"]
    if not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
        raise ManifestError(file, f"{where}.shape", shape, "must be a list of integers")
    try:
        return TensorContract(**table)
    except FieldError as exc:
        raise ManifestError(file, f"{where}.{exc.field}", exc.value, f"{exc.owner}: {exc.problem}") from None


def _submodel(file: str, index: int, raw: Any, vocab_size: int, hidden_size: int) -> SubmodelContract:
    where = f"submodel[{index}]"
    table = _table(file, where, raw, _SUB_KEYS, set())
    kind_name = table["kind"]
    try:
        kind = TaskKind[kind_name.upper()]
    except KeyError:
        raise ManifestError(file, f"{where}.kind", kind_name,
                            f"unknown kind (allowed: {', '.join(k.name.lower() for k in TaskKind)})") from None
    fields = {k: v for k, v in table.items() if k not in _TENSOR_ROLES and k != "kind"}
    tensors: dict[str, Any] = {role: _tensor(file, f"{where}.{role}", table[role])
                               for role in _TENSOR_ROLES}
    try:
        sub = SubmodelContract(kind=kind, **fields, **tensors)
        validate_submodels({kind: sub}, vocab_size, hidden_size)
    except FieldError as exc:
        raise ManifestError(file, f"{where}.{exc.field}", exc.value, f"{exc.owner}: {exc.problem}") from None
    return sub


def _check_equal(owner: str, field: str, expected: Any, actual: Any) -> Status | None:
    if expected == actual:
        return None
    return Status.artifact("tensor_mismatch", f"{owner}: {field} manifest={expected!r} runtime={actual!r}")


def _check_tensor(model: str, contract: TensorContract, found: Sequence[RuntimeTensorInfo]) -> Status | None:
    """Compare one tensor contract with the runtime tensors of the same exact name."""
    matches = [t for t in found if t.name == contract.name]
    owner = f"model {model!r} tensor {contract.name!r}"
    if len(matches) != 1:
        reason = "tensor_missing" if not matches else "tensor_duplicate"
        return Status.artifact(reason, f"{owner}: the runtime reports it {len(matches)} times, expected exactly once")
    rt = matches[0]
    return (
        _check_equal(owner, "dtype", contract.dtype.value, rt.dtype)
        or _check_equal(owner, "rank", contract.rank, len(rt.shape))
        or _check_equal(owner, "shape", list(contract.shape), list(rt.shape))
        or _check_equal(owner, "byte_size", contract.byte_size, rt.byte_size)
        or _check_equal(owner, "sliceable", contract.sliceable, rt.sliceable)
    )


def _check_model(sub: SubmodelContract, rt: RuntimeModelInfo) -> Status | None:
    """Everything the manifest says about one submodel, against the runtime's model."""
    for contract, found in ((sub.token_or_embed, rt.inputs), (sub.position, rt.inputs), (sub.logits, rt.outputs)):
        status = _check_tensor(rt.name, contract, found)
        if status is not None:
            return status
    for csr in (sub.csr_cur_seq, sub.csr_total_seq):
        if csr not in rt.csr_names:
            return Status.artifact(
                "csr_missing",
                f"model {rt.name!r}: CSR {csr!r} not in runtime CSRs {list(rt.csr_names)}")
    for key in META_KEYS:
        expected, actual = getattr(sub, key), rt.meta.get(key)
        if actual != expected:
            return Status.artifact("meta_mismatch",
                                   f"model {rt.name!r}: {key} manifest={expected} graph metadata={actual}")
    return None


@attrs.frozen
class Manifest:
    """A loaded, self-consistent manifest; ``source`` names the file it came from."""

    name: str
    calrt_version: str
    calbin_sha256: str | None
    vocab_size: int
    hidden_size: int
    submodels: Mapping[TaskKind, SubmodelContract] = attrs.field(hash=False)
    source: str
    #: runtime models the calbin carries that calexec never runs (exact names): listed so
    #: that the manifest still describes the calbin completely (§10.2)
    ignored_models: tuple[str, ...] = ()
    #: the goldens pinned next to the manifest (``<stem>.goldens.toml``, contracts/goldens.py)
    goldens: Goldens = attrs.field(default=NO_GOLDENS, hash=False)

    def unlisted(self, models: Sequence[RuntimeModelInfo]) -> tuple[str, ...]:
        """Runtime model names the manifest lists neither as a submodel nor as ignored (each
        one keeps the generation from Ready, §10.2)."""
        listed = {sub.exact_name for sub in self.submodels.values()} | set(self.ignored_models)
        return tuple(dict.fromkeys(m.name for m in models if m.name not in listed))

    def resolve(self, models: Sequence[RuntimeModelInfo], generation_id: int,
                calbin_sha256: str) -> ModelGeneration | Status:
        """The generation these runtime models form, or an ARTIFACT Status naming the offender.

        Refuses (code ``manifest.<reason>``): sha256 not 64 hex digits (``bad_sha256``) or not
        the pinned one (``sha256_mismatch``); a manifest name absent from (``model_missing``) or
        repeated in (``model_duplicate``) the runtime list; a tensor missing/duplicated or
        differing in dtype, rank, shape, byte_size or sliceable (``tensor_*``); a CSR name absent
        (``csr_missing``); logits_tile_d0/max_seq/max_batch differing from the graph metadata
        (``meta_mismatch``); a runtime model the manifest lists neither as a submodel nor in
        ``ignored_models`` (``model_unlisted``, every such name in the message, §10.2).
        """
        sha = calbin_sha256.lower() if isinstance(calbin_sha256, str) else calbin_sha256
        if not isinstance(sha, str) or not SHA256_RE.fullmatch(sha):
            return Status.artifact("bad_sha256", f"calbin_sha256={calbin_sha256!r}: must be 64 hex digits")
        if self.calbin_sha256 is not None and sha != self.calbin_sha256:
            return Status.artifact("sha256_mismatch",
                                   f"calbin_sha256={sha} but {self.source} pins {self.calbin_sha256}")
        refused = self.models_refusal(models)
        if refused is not None:
            return refused
        return ModelGeneration(
            generation_id=generation_id, calbin_sha256=sha, calrt_version=self.calrt_version,
            submodels=self.submodels, vocab_size=self.vocab_size, hidden_size=self.hidden_size,
        )

    def models_refusal(self, models: Sequence[RuntimeModelInfo]) -> Status | None:
        """None when these runtime models are the ones the manifest describes, else the
        ARTIFACT Status :meth:`resolve` refuses them with (every ``manifest.<reason>`` but the
        sha256's): what a check needing no sha256 (an unpinned manifest) calls."""
        by_name = collections.defaultdict(list)
        for model in models:
            by_name[model.name].append(model)
        for sub in self.submodels.values():
            found = by_name.get(sub.exact_name, [])
            if len(found) != 1:
                reason = "model_missing" if not found else "model_duplicate"
                return Status.artifact(
                    reason,
                    f"{sub.kind.name} exact_name={sub.exact_name!r}: the runtime reports it {len(found)} times, "
                    f"expected exactly once (runtime models: {sorted(by_name)})",
                )
            status = _check_model(sub, found[0])
            if status is not None:
                return status
        unlisted = self.unlisted(models)
        if unlisted:
            return Status.artifact(
                "model_unlisted",
                f"runtime models {list(unlisted)} are not listed in {self.source} (neither a "
                f"[[submodel]] exact_name nor in ignored_models); §10.2 refuses Ready on a "
                f"calbin with models the manifest does not describe",
            )
        return None


def load_manifest(path: str | Path) -> Manifest:
    """Parse and validate a manifest file; raises :class:`ManifestError` (or ``OSError``)."""
    file = str(path)
    try:
        raw = read_toml(path)
    except tomllib.TOMLDecodeError as exc:
        raise ManifestError(file, "<toml>", ABSENT, f"not valid TOML: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ManifestError(file, "<toml>", ABSENT, f"not UTF-8 text: {exc.reason} at byte "
                            f"{exc.start}") from None
    table = _table(file, "", raw, _TOP_KEYS, _TOP_OPTIONAL)
    for key in ("vocab_size", "hidden_size"):
        if table[key] <= 0:
            raise ManifestError(file, key, table[key], "must be > 0")
    sha = table.get("calbin_sha256")
    if sha is not None and not SHA256_RE.fullmatch(sha):
        raise ManifestError(file, "calbin_sha256", sha, "must be 64 lower-case hex digits")
    submodels: dict[TaskKind, SubmodelContract] = {}
    names: dict[str, int] = {}
    for index, entry in enumerate(table["submodel"]):
        sub = _submodel(file, index, entry, table["vocab_size"], table["hidden_size"])
        if sub.kind in submodels:
            raise ManifestError(file, f"submodel[{index}].kind", sub.kind.name.lower(), "kind listed twice")
        if sub.exact_name in names:
            raise ManifestError(file, f"submodel[{index}].exact_name", sub.exact_name,
                                f"name already used by submodel[{names[sub.exact_name]}]")
        submodels[sub.kind] = sub
        names[sub.exact_name] = index
    if not submodels:
        raise ManifestError(file, "submodel", [], "at least one [[submodel]] is required")
    ignored = table.get("ignored_models", [])
    for index, entry in enumerate(ignored):
        key = f"ignored_models[{index}]"
        if not isinstance(entry, str) or not entry:
            raise ManifestError(file, key, entry, "must be a non-empty string (an exact model name)")
        if entry in names:
            raise ManifestError(file, key, entry,
                                f"is submodel[{names[entry]}]'s exact_name; a model is served or ignored")
        if entry in ignored[:index]:
            raise ManifestError(file, key, entry, "listed twice")
    try:
        goldens = load_goldens(goldens_path(path))
    except GoldenFileError as exc:
        raise ManifestError(exc.file, exc.key, exc.value, exc.problem) from None
    return Manifest(name=table["name"], calrt_version=table["calrt_version"], calbin_sha256=sha,
                    vocab_size=table["vocab_size"], hidden_size=table["hidden_size"],
                    submodels=types.MappingProxyType(submodels), source=file,
                    ignored_models=tuple(ignored), goldens=goldens)


def default_manifest_path() -> Path:
    """The packaged manifest of the bundled emulator's synthetic Qwen3 calbin."""
    return Path(str(resources.files("calexec.contracts").joinpath("manifests", "qwen3_synthetic.toml")))
