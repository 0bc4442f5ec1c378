"""The synthetic calbin format: a pure-Python writer and reader.

Text, UTF-8, one directive per line (the emulator's parser in ``calrt/emulator.c`` is
its twin)::

    CALBIN 1
    seed <u64>
    model <name> <kind>                          kind: prefill_ids | prefill_embeds | decode
    salt <u64>                                   optional, XORed into the state before logits
    meta <key> <i64>
    input <name> <dtype> <sliceable 0|1> <d0,d1,...>
    output <name> <dtype> 0 <d0,d1,...>
    csr <name>
    end

The bytes are a pure function of the parameters, so the file's sha256 identifies the
model generation. The default calbin holds the three Qwen3 graphs and a decoy
(``qwen3_decode_s40960_b1_draft``, a different salt) whose name has the decode graph's name
as a prefix: substring lookup picks the wrong graph and the tokens then differ.
"""

from __future__ import annotations

import hashlib

import attrs

MAX_SEQ = 40960
VOCAB = 151936
DEFAULT_TILE_D0 = 16
DEFAULT_HIDDEN = 64
DEFAULT_SEED = 0x0C0FFEE
#: the most elements a tensor may hold: the bundled emulator's loader refuses a larger one
#: (``parse_tensor`` in drivers/calrt/emulator.c, checked dimension by dimension)
MAX_TENSOR_ELEMS = 1 << 40
#: the largest ``hidden`` (``inputs_embeds`` is 1 x MAX_SEQ x hidden) and ``tile_d0``
#: (``logits`` is 1 x tile_d0 x VOCAB) of a calbin that loader takes
MAX_HIDDEN = MAX_TENSOR_ELEMS // MAX_SEQ
MAX_TILE_D0 = MAX_TENSOR_ELEMS // VOCAB
DECOY_SALT = 0x5A17D1CE0DDBA11
KINDS = ("prefill_ids", "prefill_embeds", "decode")

PREFILL_IDS = "qwen3_prefill_ids_s40960_b1"
PREFILL_EMBEDS = "qwen3_prefill_embeds_s40960_b1"
DECODE = "qwen3_decode_s40960_b1"
DECOY = "qwen3_decode_s40960_b1_draft"


@attrs.frozen
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[int, ...] = attrs.field(converter=tuple[int, ...])
    sliceable: bool = False


@attrs.frozen
class ModelSpec:
    name: str
    kind: str = attrs.field(validator=attrs.validators.in_(KINDS))
    inputs: tuple[TensorSpec, ...] = attrs.field(converter=tuple[TensorSpec, ...])
    outputs: tuple[TensorSpec, ...] = attrs.field(converter=tuple[TensorSpec, ...])
    csrs: tuple[str, ...] = attrs.field(converter=tuple[str, ...])
    meta: tuple[tuple[str, int], ...] = attrs.field(converter=tuple[tuple[str, int], ...])
    salt: int = 0


@attrs.frozen
class CalbinSpec:
    seed: int
    models: tuple[ModelSpec, ...] = attrs.field(converter=tuple[ModelSpec, ...])

    def model(self, name: str) -> ModelSpec:
        """The model with exactly this name (KeyError naming it otherwise)."""
        for m in self.models:
            if m.name == name:
                return m
        raise KeyError(f"calbin has no model named {name!r}")


def default_spec(tile_d0: int = DEFAULT_TILE_D0, seed: int = DEFAULT_SEED, hidden: int = DEFAULT_HIDDEN) -> CalbinSpec:
    """The default synthetic Qwen3 calbin (prefill ids/embeds, decode, decoy)."""
    if not 1 <= tile_d0 <= MAX_TILE_D0:
        raise ValueError(f"tile_d0 must be in 1..{MAX_TILE_D0}, got {tile_d0}")
    if not 0 <= seed < 2**64:
        raise ValueError(f"seed must be a u64, got {seed}")
    if not 1 <= hidden <= MAX_HIDDEN:
        raise ValueError(f"hidden must be in 1..{MAX_HIDDEN}, got {hidden}")
    csrs = ("cur_seq_len", "total_seq_len")

    def meta(d0: int) -> tuple[tuple[str, int], ...]:
        return (("logits_tile_d0", d0), ("max_seq", MAX_SEQ), ("max_batch", 1), ("vocab", VOCAB), ("hidden", hidden))

    pos = TensorSpec("positions", "S32", (1, MAX_SEQ), True)
    prefill_out = (TensorSpec("logits", "BF16", (1, tile_d0, VOCAB)),)
    decode_in = (TensorSpec("input_ids", "S32", (1, 1)), TensorSpec("positions", "S32", (1, 1)))
    decode_out = (TensorSpec("logits", "BF16", (1, 1, VOCAB)),)
    return CalbinSpec(
        seed=seed,
        models=(
            ModelSpec(PREFILL_IDS, "prefill_ids", (TensorSpec("input_ids", "S32", (1, MAX_SEQ), True), pos),
                      prefill_out, csrs, meta(tile_d0)),
            ModelSpec(PREFILL_EMBEDS, "prefill_embeds",
                      (TensorSpec("inputs_embeds", "BF16", (1, MAX_SEQ, hidden), True), pos),
                      prefill_out, csrs, meta(tile_d0)),
            ModelSpec(DECODE, "decode", decode_in, decode_out, csrs, meta(1)),
            ModelSpec(DECOY, "decode", decode_in, decode_out, csrs, meta(1), salt=DECOY_SALT),
        ),
    )


def _tensor_line(word: str, t: TensorSpec) -> str:
    return f"{word} {t.name} {t.dtype} {int(t.sliceable)} {','.join(str(d) for d in t.shape)}\n"


def dumps(spec: CalbinSpec) -> bytes:
    """The calbin bytes of spec (deterministic)."""
    out = ["CALBIN 1\n", f"seed {spec.seed}\n"]
    for m in spec.models:
        out.append(f"model {m.name} {m.kind}\n")
        if m.salt:
            out.append(f"salt {m.salt}\n")
        out.extend(f"meta {k} {v}\n" for k, v in m.meta)
        out.extend(_tensor_line("input", t) for t in m.inputs)
        out.extend(_tensor_line("output", t) for t in m.outputs)
        out.extend(f"csr {c}\n" for c in m.csrs)
        out.append("end\n")
    return "".join(out).encode("utf-8")


def write(path: str, spec: CalbinSpec | None = None) -> str:
    """Write spec (default: ``default_spec()``) to path; returns the file's sha256 hex."""
    data = dumps(spec if spec is not None else default_spec())
    with open(path, "wb") as f:
        f.write(data)
    return hashlib.sha256(data).hexdigest()


#: the fields each directive takes, no more: the emulator's loader refuses a line with
#: anything after them (since stop 73)
ARITY = {"seed": 1, "model": 2, "salt": 1, "meta": 2, "input": 4, "output": 4, "csr": 1,
         "end": 0}


def _int(text: str, signed: bool = False) -> int:
    """A calbin's integer field as the C loader reads it: ASCII digits (a ``-`` first when
    ``signed``), within a u64 (an i64 when ``signed``); ValueError otherwise (``int()``
    alone took ``+5``, ``1_000`` and any size)."""
    if not (text.isascii() and (text[1:] if signed and text.startswith("-") else text).isdigit()):
        raise ValueError(f"{text[:40]!r} is not a decimal integer")
    value = int(text)
    low, high = (-(1 << 63), (1 << 63) - 1) if signed else (0, (1 << 64) - 1)
    if not low <= value <= high:
        raise ValueError(f"{text[:40]} is outside [{low}, {high}]")
    return value


def loads(data: bytes) -> CalbinSpec:
    """Parse calbin bytes; ValueError naming the line on a malformed file."""
    if not data.endswith(b"\n"):
        raise ValueError("not a calbin: every line, the last included, ends with a newline")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:  # (named by its line, as every other refusal)
        no = data[:err.start].count(b"\n") + 1
        raise ValueError(f"calbin line {no}: not UTF-8 ({err.reason} at byte {err.start})"
                         ) from None
    lines = text.split("\n")[:-1]
    if not lines or lines[0] != "CALBIN 1":
        raise ValueError(f"not a calbin: header is {lines[0][:40]!r}, expected 'CALBIN 1'")
    seed = None
    models: list[ModelSpec] = []
    cur: dict | None = None
    for no, line in enumerate(lines[1:], start=2):
        if not line:  # the C loader refuses blank lines too (19): one format, one grammar
            raise ValueError(f"line {no}: blank line")
        word, _, rest = line.partition(" ")
        args = rest.split()
        try:
            if word in ARITY and len(args) != ARITY[word]:  # (the C loader refuses more too)
                raise ValueError(f"{word!r} takes {ARITY[word]} fields, got {len(args)}")
            if word in ("input", "output") and args[2] not in ("0", "1"):
                raise ValueError(f"sliceable must be 0 or 1, got {args[2][:20]!r}")
            if word == "seed" and cur is None:
                seed = _int(args[0])
            elif word == "model" and cur is None:
                cur = {"name": args[0], "kind": args[1], "inputs": [], "outputs": [], "csrs": [], "meta": [], "salt": 0}
            elif word == "salt" and cur is not None:
                cur["salt"] = _int(args[0])
            elif word == "meta" and cur is not None:
                cur["meta"].append((args[0], _int(args[1], signed=True)))
            elif word in ("input", "output") and cur is not None:
                shape = tuple(_int(d) for d in args[3].split(","))
                cur[word + "s"].append(TensorSpec(args[0], args[1], shape, args[2] == "1"))
            elif word == "csr" and cur is not None:
                cur["csrs"].append(args[0])
            elif word == "end" and cur is not None:
                models.append(ModelSpec(**cur))
                cur = None
            else:
                raise ValueError(f"unexpected directive {word!r}")
        except (IndexError, ValueError, TypeError) as exc:
            raise ValueError(f"calbin line {no}: {line!r}: {exc}") from None
    if seed is None or cur is not None:
        raise ValueError("calbin: missing seed or unterminated model")
    return CalbinSpec(seed=seed, models=tuple(models))


def read(path: str) -> CalbinSpec:
    with open(path, "rb") as f:
        return loads(f.read())
