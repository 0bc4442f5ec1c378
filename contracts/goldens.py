"""Pinned goldens (spec §9.2): the expected output of the fixed warm-up run, per calbin sha256.

§9.2 asks for a *fixed* prefill+decode golden before a generation takes traffic. A golden that
is recorded the first time a calbin is seen checks nothing on that first run (a new calbin on a
model switch would pass by definition), so the expected tokens are pinned in a file next to the
manifest, ``<manifest stem>.goldens.toml`` (``goldens_path``), written by
``calexec golden record --calbin X [--manifest M]`` and loaded with the manifest
(``Manifest.goldens``). Format (docs/manifest.md §6)::

    format = 1

    [[golden]]
    calbin_sha256 = "<64 lower-case hex digits>"
    prompt = [1, 2, 3]        # the warm-up prompt (ExecutorConfig.golden_tokens)
    decode_steps = 2          # greedy decode steps after the prefill (golden_decode_steps)
    tokens = [7, 8, 9]        # expected argmax: the prefill's, then one per decode step
    note = "free text"        # optional: where the calbin came from, who recorded it

A golden applies only to the prompt and decode steps it was recorded with. Loading raises
``GoldenFileError`` (a ``ManifestError``: file, key, value, problem) for anything malformed.
"""

from __future__ import annotations

import os
import stat
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import attrs

from calexec.contracts.files import read_toml, write_whole
from calexec.contracts.types import SHA256_RE

FORMAT = 1
_KEYS = {"calbin_sha256": str, "prompt": list, "decode_steps": int, "tokens": list, "note": str}
_OPTIONAL = {"note"}


class GoldenFileError(ValueError):
    """A goldens file is malformed (``file``, ``key``, ``value``, ``problem``, as
    ``ManifestError``; ``value`` None: no value to show, a file that is not TOML or a key
    missing, said as ``ManifestError`` says it, not ``<toml>=None``)."""

    def __init__(self, file: str, key: str, value: object, problem: str) -> None:
        self.file, self.key, self.value, self.problem = file, key, value, problem
        shown = "" if value is None else f"={value!r}"
        super().__init__(f"{file}: {key}{shown}: {problem}")


@attrs.frozen
class PinnedGolden:
    """The expected tokens of one calbin's warm-up run with one prompt."""

    calbin_sha256: str
    prompt: tuple[int, ...] = attrs.field(converter=tuple[int, ...])
    decode_steps: int
    tokens: tuple[int, ...] = attrs.field(converter=tuple[int, ...])
    note: str = attrs.field(default="")

    @note.validator
    def _storable(self, attribute: attrs.Attribute[str], value: str) -> None:
        # a lone surrogate (a byte of a command-line argument or a file name that is not
        # UTF-8) has no TOML form: written as ``\udcff`` it made the whole goldens file
        # unreadable, every golden in it lost to every command that loads the manifest
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"PinnedGolden.note={value!r}: not Unicode text (U+"
                             f"{ord(value[exc.start]):04X} at character {exc.start + 1}, a "
                             "byte that was not UTF-8); a goldens file cannot hold it") from None

    def matches(self, prompt: Iterable[int], decode_steps: int) -> bool:
        return self.prompt == tuple(prompt) and self.decode_steps == decode_steps


#: calbin sha256 -> its pinned goldens (one per prompt / decode steps)
Goldens = Mapping[str, tuple[PinnedGolden, ...]]
NO_GOLDENS: Goldens = MappingProxyType({})


def goldens_path(manifest_path: str | Path) -> Path:
    """The goldens file that belongs to ``manifest_path`` (``m.toml`` -> ``m.goldens.toml``)."""
    path = Path(manifest_path)
    return path.with_name(f"{path.stem}.goldens.toml")


def _ints(file: str, key: str, value: Any, minimum: int) -> tuple[int, ...]:
    if not value or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                            for v in value):
        raise GoldenFileError(file, key, value, "must be a non-empty list of integers >= 0")
    if len(value) < minimum:
        raise GoldenFileError(file, key, value, f"must hold at least {minimum} integers")
    return tuple(value)


def load_goldens(path: str | Path) -> Goldens:
    """The pinned goldens in ``path``; an absent file pins nothing (empty mapping)."""
    file = str(path)
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return NO_GOLDENS
    if not stat.S_ISREG(mode):  # (a FIFO would wait for a writer, /dev/zero never end)
        raise GoldenFileError(file, "<file>", stat.filemode(mode), "not a regular file")
    try:
        raw = read_toml(path)
    except FileNotFoundError:
        return NO_GOLDENS
    except tomllib.TOMLDecodeError as exc:
        raise GoldenFileError(file, "<toml>", None, f"not valid TOML: {exc}") from None
    except UnicodeDecodeError as exc:
        raise GoldenFileError(file, "<toml>", None, f"not UTF-8 text: {exc.reason} at byte "
                              f"{exc.start}") from None
    for key in raw:
        if key not in ("format", "golden"):
            raise GoldenFileError(file, key, raw[key], "unknown key (allowed: format, golden)")
    if raw.get("format") != FORMAT:
        raise GoldenFileError(file, "format", raw.get("format"), f"must be {FORMAT}")
    entries = raw.get("golden", [])
    if not isinstance(entries, list):
        raise GoldenFileError(file, "golden", entries, "must be an array of tables [[golden]]")
    by_sha: dict[str, list[PinnedGolden]] = {}
    for index, entry in enumerate(entries):
        where = f"golden[{index}]"
        if not isinstance(entry, dict):
            raise GoldenFileError(file, where, entry, "must be a table")
        for key, value in entry.items():
            if key not in _KEYS:
                raise GoldenFileError(file, f"{where}.{key}", value,
                                      f"unknown key (allowed: {', '.join(sorted(_KEYS))})")
        for key, kind in _KEYS.items():
            if key not in entry:
                if key in _OPTIONAL:
                    continue
                raise GoldenFileError(file, f"{where}.{key}", None, "missing required key")
            value = entry[key]
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise GoldenFileError(file, f"{where}.{key}", value, f"must be a {kind.__name__}")
        sha = entry["calbin_sha256"]
        if not SHA256_RE.fullmatch(sha) or sha != sha.lower():
            raise GoldenFileError(file, f"{where}.calbin_sha256", sha,
                                  "must be 64 lower-case hex digits")
        steps = entry["decode_steps"]
        if steps < 0:
            raise GoldenFileError(file, f"{where}.decode_steps", steps, "must be >= 0")
        golden = PinnedGolden(sha, _ints(file, f"{where}.prompt", entry["prompt"], 1), steps,
                              _ints(file, f"{where}.tokens", entry["tokens"], 1),
                              entry.get("note", ""))
        if len(golden.tokens) != steps + 1:
            raise GoldenFileError(file, f"{where}.tokens", entry["tokens"],
                                  f"must hold decode_steps + 1 = {steps + 1} tokens")
        same = [g for g in by_sha.get(sha, []) if g.matches(golden.prompt, steps)]
        if same:
            raise GoldenFileError(file, f"{where}.calbin_sha256", sha,
                                  "pinned twice for the same prompt and decode_steps")
        by_sha.setdefault(sha, []).append(golden)
    return MappingProxyType({sha: tuple(gs) for sha, gs in by_sha.items()})


def lookup(goldens: Goldens, sha256: str, prompt: Iterable[int],
           decode_steps: int) -> PinnedGolden | None:
    """The golden pinned for this calbin, prompt and decode steps, if any."""
    prompt = tuple(prompt)
    for golden in goldens.get(sha256, ()):
        if golden.matches(prompt, decode_steps):
            return golden
    return None


def _toml_str(text: str) -> str:
    escaped = text.replace("\\", "\\\\").replace('"', '\\"')
    return '"' + "".join(c if c.isprintable() else f"\\u{ord(c):04x}" for c in escaped) + '"'


def dumps(goldens: Goldens) -> str:
    """TOML text of ``goldens`` (sorted by sha256, then prompt), loadable by ``load_goldens``."""
    lines = ["# calexec pinned goldens (docs/manifest.md section 6); written by",
             "# `calexec golden record`. One [[golden]] per calbin sha256 and warm-up prompt.",
             f"format = {FORMAT}"]
    for sha in sorted(goldens):
        for g in sorted(goldens[sha], key=lambda g: (g.prompt, g.decode_steps)):
            lines += ["", "[[golden]]", f"calbin_sha256 = {_toml_str(g.calbin_sha256)}",
                      f"prompt = [{', '.join(map(str, g.prompt))}]",
                      f"decode_steps = {g.decode_steps}",
                      f"tokens = [{', '.join(map(str, g.tokens))}]"]
            if g.note:
                lines.append(f"note = {_toml_str(g.note)}")
    return "\n".join(lines) + "\n"


def pin(path: str | Path, golden: PinnedGolden) -> Goldens:
    """Add ``golden`` to the file at ``path`` (replacing the entry for the same calbin, prompt
    and decode steps), written atomically; returns the file's new content."""
    current = load_goldens(path)
    merged = {sha: list(gs) for sha, gs in current.items()}
    kept = [g for g in merged.get(golden.calbin_sha256, [])
            if not g.matches(golden.prompt, golden.decode_steps)]
    merged[golden.calbin_sha256] = kept + [golden]
    result: Goldens = MappingProxyType({sha: tuple(gs) for sha, gs in merged.items()})
    # whole or not at all, the file keeping its mode (a new one gets open()'s, the umask
    # applied: mkstemp's 0600 made a goldens file the server reads as another user
    # unreadable to it); a symlink stays, the file it points to replaced
    write_whole(os.fspath(path), dumps(result).encode("utf-8"))
    return result
