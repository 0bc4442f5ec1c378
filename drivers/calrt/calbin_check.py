"""The bundled emulator's calbin grammar, read on the host without a device.

``inspect(data)`` is the Python twin of ``calbin_parse``/``parse_tensor`` in
``calrt/emulator.c`` (its dtype, rank and directive rules; the Qwen3 execution contract of
``model_finish`` is left to the manifest): it returns the models the emulator's
``GetAllModels`` would report for ``data``, as ``RuntimeModelInfo`` values, or one line saying
why the emulator would refuse the file. It never raises and never touches a device, so a
model switch can be refused before the lifecycle moves (``DeviceExecutor.check_calbin``,
reached through ``CalRT.inspect_calbin``). Whatever this twin lets through and the C loader
refuses is still refused by the switch itself (rolled back, the previous model serving).
"""

from __future__ import annotations

import re

from calexec.contracts.runtime_view import RuntimeModelInfo, RuntimeTensorInfo

#: calrt.h / emu_internal.h limits
NAME_MAX = 64  # names include the terminating NUL
MAX_RANK = 8
MAX_MODELS, MAX_TENSORS, MAX_CSRS, MAX_META = 16, 8, 8, 16
LINE_MAX = 1023  # fgets into char[1024]: a line, its newline included
#: the largest file the grammar can hold (16 models of at most 1 + 1 + 16 + 16 + 8 + 1 lines)
#: with room to spare; anything larger is not an emulator calbin
MAX_BYTES = 1 << 20
KINDS = ("prefill_ids", "prefill_embeds", "decode")
DTYPE_BYTES = {"U8": 1, "S32": 4, "F32": 4, "BF16": 2, "F16": 2, "S64": 8}
HEADER = b"CALBIN 1\n"
_LEADING_INT = re.compile(r"[+-]?[0-9]+")


def _scan(text: str) -> int | None:
    """The integer at the start of ``text`` as scanf's %lld/%llu/%d reads it (an optional sign,
    then digits; what follows them is ignored), or None when there is none."""
    match = _LEADING_INT.match(text)
    return int(match.group(0)) if match else None


def _dim(text: str) -> int | None:
    """One dimension as ``parse_tensor`` reads it (strtoull, nothing after it): 1..2^32."""
    if not _LEADING_INT.fullmatch(text):
        return None
    value = int(text)
    return value if 1 <= value <= 1 << 32 else None


def _tensor(args: list[str]) -> RuntimeTensorInfo | str:
    """``<name> <dtype> <sliceable> <d0,d1,...>`` as ``sscanf("%63s %15s %d %255s")`` reads it
    (the %d stops at the first non-digit: the dims may follow it with no blank between)."""
    sliced = _LEADING_INT.match(args[2]) if len(args) >= 3 else None
    if sliced is not None and sliced.end() < len(args[2]):
        args = [*args[:2], sliced.group(0), args[2][sliced.end():]]
    if len(args) < 4:
        return "a tensor line needs <name> <dtype> <sliceable> <d0,d1,...>"
    name, dtype, sliceable, dims = args[:4]
    if len(name) >= NAME_MAX:
        return f"tensor name {name[:40]!r}... is longer than {NAME_MAX - 1} characters"
    if dtype not in DTYPE_BYTES:
        return f"tensor {name!r}: dtype {dtype[:16]!r} is not one of {', '.join(DTYPE_BYTES)}"
    if _scan(sliceable) not in (0, 1):
        return f"tensor {name!r}: sliceable {sliceable[:8]!r} is not 0 or 1"
    shape: list[int] = []
    elems = 1
    for text in dims.split(","):
        d = _dim(text)
        if d is None or len(shape) == MAX_RANK or elems > (1 << 40) // d:
            return f"tensor {name!r}: shape {dims[:60]!r} is not {MAX_RANK} or fewer dims in " \
                   f"1..2^32 (2^40 elements at most)"
        shape.append(d)
        elems *= d
    if len(shape) < 2:
        return f"tensor {name!r}: shape {dims!r} has rank {len(shape)}, at least 2 needed"
    return RuntimeTensorInfo(name=name, shape=shape, dtype=dtype,
                             byte_size=elems * DTYPE_BYTES[dtype], sliceable=_scan(sliceable) == 1)


def inspect(data: bytes) -> tuple[RuntimeModelInfo, ...] | str:
    """The models of calbin ``data`` (in file order), or why the emulator refuses it: a bad
    header (the loader's 12), or the line whose content it refuses (its 19)."""
    if len(data) > MAX_BYTES:
        return f"{len(data)} bytes: larger than any emulator calbin ({MAX_BYTES} at most)"
    if not data.startswith(HEADER):
        return f"not a calbin: the header is {data[:16]!r}, expected {HEADER!r}"
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        return f"not UTF-8 text at byte {err.start}"
    lines = text.split("\n")
    if lines[-1] != "":
        return f"line {len(lines)}: does not end with a newline"
    models: list[RuntimeModelInfo] = []
    seed = False
    cur: dict | None = None
    for no, line in enumerate(lines[1:-1], start=2):
        if len(line) + 1 > LINE_MAX or "\x00" in line:
            return f"line {no}: longer than {LINE_MAX - 1} characters or holds a NUL"
        args = line.split()
        if not args:
            return f"line {no}: blank line"
        # (as the C loader: the arguments start len(word) characters into the line, so a line
        # that starts with blanks has them read from the middle of its first word)
        word, rest = args[0], line[len(args[0]):].split()
        problem: str | None = None
        if cur is None and word == "seed" and rest and _scan(rest[0]) is not None:
            seed = True
        elif cur is None and word == "model" and len(rest) >= 2:
            if len(models) == MAX_MODELS:
                problem = f"more than {MAX_MODELS} models"
            elif rest[1] not in KINDS:
                problem = f"model kind {rest[1][:32]!r} is not one of {', '.join(KINDS)}"
            elif len(rest[0]) >= NAME_MAX:
                problem = f"model name is longer than {NAME_MAX - 1} characters"
            cur = {"name": rest[0], "inputs": [], "outputs": [], "csrs": [], "meta": []}
        elif cur is not None and word == "salt" and rest and _scan(rest[0]) is not None:
            pass
        elif cur is not None and word == "meta" and len(rest) >= 2 and len(cur["meta"]) < MAX_META \
                and _scan(rest[1]) is not None:
            cur["meta"].append((rest[0], _scan(rest[1]) or 0))
        elif cur is not None and word in ("input", "output"):
            kept = cur[word + "s"]
            tensor = _tensor(rest) if len(kept) < MAX_TENSORS else f"more than {MAX_TENSORS} {word}s"
            if isinstance(tensor, str):
                problem = tensor
            else:
                kept.append(tensor)
        elif cur is not None and word == "csr" and rest and len(cur["csrs"]) < MAX_CSRS:
            cur["csrs"].append(rest[0])
        elif cur is not None and word == "end":
            if not cur["inputs"] or not cur["outputs"]:
                problem = f"model {cur['name']!r} has no inputs or no outputs"
            else:
                models.append(RuntimeModelInfo(name=cur["name"], inputs=cur["inputs"],
                                               outputs=cur["outputs"], csr_names=cur["csrs"],
                                               meta=dict(cur["meta"])))  # (as runtime.py reads it)
                cur = None
        else:
            problem = f"directive {word[:16]!r} not expected here"
        if problem is not None:
            return f"line {no}: {problem}: {line[:80]!r}"
    if cur is not None:
        return f"model {cur['name']!r} has no 'end' line"
    if not seed or not models:
        return "no 'seed' line" if not seed else "no model"
    names = [m.name for m in models]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        return f"model names {repeated} appear more than once"
    return tuple(models)
