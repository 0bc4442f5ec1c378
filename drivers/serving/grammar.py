"""Structured outputs and tools (issue 27): the OpenAI ``response_format`` (``json_object``,
``json_schema``) and ``tools``/``tool_choice`` as a grammar, compiled by llguidance
(https://github.com/guidance-ai/llguidance, the ``[server]`` extra), whose token mask is
applied to the FP32 row before sampling (drivers/serving/sampling.py, greedy and sampled) and
which advances with each accepted token; the choice ends (``finish_reason`` ``"stop"``, or
``"tool_calls"``) when the grammar is complete.

- :func:`chat_structure` / :func:`completion_structure`: the request's fields -> a
  :class:`Structure` (a ``sampling.GrammarSpec``: each generation starts its own
  :class:`Constraint`), or :class:`GrammarError` naming the bad field and why (a schema
  llguidance cannot compile: its message). Without llguidance installed every field that
  needs a grammar is refused naming the package to install.
- Tools are called in Qwen3's format, one call per block,
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``: :func:`parse_tool_calls`
  reads a finished text, :class:`ToolCallStream` turns streamed text into OpenAI's
  ``delta.tool_calls`` pieces.
- :func:`history_message` renders an assistant turn's ``tool_calls`` and ``tool`` messages for
  the chat template (the plain template writes the calls in the same format).

llguidance is imported only when a grammar is compiled (the module itself needs only numpy).
"""

from __future__ import annotations

import decimal
import json
import math
import re
import threading
import urllib.parse
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np

from calexec.contracts.fields import shown
from calexec.drivers.serving.byte_tokenizer import BYTE_OFFSET, ByteTokenizer, is_byte_token

if TYPE_CHECKING:
    from calexec.drivers.serving.hf_tokenizer import Tokenizer

#: the package and how to get it (the message of every refusal without it)
PACKAGE = "llguidance"
INSTALL = "pip install 'calexec[server]' (llguidance>=1.9,<2)"

#: Qwen3's tool call delimiters (its chat template and its output)
CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
#: OpenAI's function names (whole: ``fullmatch``, as ``$`` also matched before a final line
#: feed, so ``"get_weather\n"`` was taken until stop 72)
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
#: how JSON is written under a grammar: compact, no free whitespace (a model could otherwise
#: add whitespace for ever), as llguidance's defaults write separators
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False}


class GrammarError(ValueError):
    """A request's structured-output or tool fields cannot be honoured: ``param`` names the
    field (its path in the body), the message says why."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def missing() -> str | None:
    """Why no grammar can be compiled here (llguidance is not installed), or None."""
    try:
        import llguidance  # noqa: F401
    except ImportError as err:
        return f"needs the {shown(PACKAGE)} package, which is not installed ({err}): {INSTALL}"
    return None


# ---- the tokenizer as llguidance sees it ----------------------------------------------------
class _ByteVocabulary:
    """The synthetic model's byte-level vocabulary for ``llguidance.LLTokenizer`` (its
    ``TokenizerWrapper`` interface): ids 256..511 are the bytes; every other id renders as
    ``<id>`` and is a special token to llguidance (marker byte 0xFF), so a grammar never
    produces it; ``end_token`` ends a generation."""

    is_tokenizer_wrapper = True
    bos_token_id = None

    def __init__(self, vocab: int, end_token: int) -> None:
        self.eos_token_id = end_token
        self.tokens = [bytes((i - BYTE_OFFSET,)) if is_byte_token(i) else b"\xff<%d>" % i
                       for i in range(vocab)]
        self.special_token_ids = [i for i in range(vocab) if not is_byte_token(i)]

    def __call__(self, text: str | bytes) -> list[int]:
        data = text.encode("utf-8") if isinstance(text, str) else text
        return [BYTE_OFFSET + b for b in data]


_TOKENIZERS: dict[tuple[str, int, int], Any] = {}
#: why llguidance could not load a tokenizer (its message), by the same key: kept, so a
#: tokenizer it refuses is read once, not on every structured request
_REFUSED: dict[tuple[str, int, int], str] = {}
_TOKENIZERS_MU = threading.Lock()


def ll_tokenizer(tok: Tokenizer, vocab: int, end_token: int, param: str, what: str) -> Any:
    """The ``llguidance.LLTokenizer`` of the server's tokenizer (built once, ~0.4 s for the
    synthetic vocabulary): the byte-level one from its vocabulary, a Hugging Face one from its
    ``tokenizer.json`` (``HFTokenizer.name``), padded to the model's ``vocab``. A tokenizer
    llguidance cannot load (a ``tokenizer.json`` whose decoder is neither ByteLevel nor
    Metaspace: WordPiece, none) is :class:`GrammarError` naming ``param`` (the field asking
    for a grammar, ``what`` it asked) and llguidance's reason: no grammar can be served."""
    from llguidance import LLTokenizer
    key = (tok.name, vocab, end_token)
    with _TOKENIZERS_MU:
        built = _TOKENIZERS.get(key)
        if built is None and key not in _REFUSED:
            try:
                if isinstance(tok, ByteTokenizer):
                    built = LLTokenizer(_ByteVocabulary(vocab, end_token),  # type: ignore[arg-type]
                                        slices=LLTokenizer.json_slices())
                else:
                    built = LLTokenizer(tok.name, n_vocab=vocab,
                                        slices=LLTokenizer.json_slices())
            except ValueError as err:  # llguidance's refusal of the tokenizer itself
                _REFUSED[key] = str(err)
            else:
                _TOKENIZERS[key] = built
        if built is None:
            raise GrammarError(param, f"{param}: {what} needs a grammar over the server's "
                                      f"tokenizer {shown(tok.name)}, which llguidance cannot load "
                                      f"({_REFUSED[key]}); structured outputs and tools need "
                                      "a tokenizer.json whose decoder is ByteLevel or "
                                      "Metaspace")
        return built


# ---- the grammar's state over one generation -------------------------------------------------
class Constraint:
    """One generation's llguidance matcher (a ``sampling.RowConstraint``). The tokenizer's own
    end token is replaced by the server's ``end_token`` in the mask (a Hugging Face tokenizer's
    may differ): it is allowed exactly when the grammar may end."""

    def __init__(self, matcher: Any, vocab: int, end_token: int, ll_eos: Sequence[int],
                 finite: Any = None) -> None:
        from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask
        self._fill = fill_next_token_bitmask
        self._matcher = matcher
        #: the matcher of :data:`FINITE_JSON`'s mirror of the grammar (None: no JSON), whose
        #: mask is intersected with the grammar's: every number a double holds finitely
        self._finite = finite
        self._vocab = vocab
        self._end = end_token
        self._ll_eos = [t for t in ll_eos if t != end_token]
        self._bits = allocate_token_bitmask(1, vocab)

    def allowed(self) -> np.ndarray:
        if self._matcher.is_error() or self._matcher.is_stopped():
            mask = np.zeros(self._vocab, dtype=bool)
        else:
            mask = self._mask(self._matcher)
            if self._finite is not None and not self._finite.is_error():
                mask &= self._mask(self._finite)
        ends = mask[self._end] or any(mask[t] for t in self._ll_eos if t < self._vocab)
        for t in self._ll_eos:
            if t < self._vocab:
                mask[t] = False
        if self._end < self._vocab:
            # the end token: where the grammar may end, or when nothing else is possible
            mask[self._end] = bool(ends) or not mask.any()
        return mask

    def _mask(self, matcher: Any) -> np.ndarray:
        self._fill(matcher, self._bits)
        return np.unpackbits(self._bits[0].view(np.uint8),
                             bitorder="little")[:self._vocab].astype(bool)

    def accept(self, token: int) -> None:
        if token == self._end:
            return  # the generation ends (the server stops on it)
        self._matcher.consume_token(token)  # a refused token leaves it in an error state
        if self._finite is not None:
            self._finite.consume_token(token)

    @property
    def finished(self) -> bool:
        return bool(self._matcher.is_stopped())

    @property
    def error(self) -> str:
        if self._finite is not None and self._finite.is_error():
            return f"a number past a double's range: {self._finite.get_error()}"
        return str(self._matcher.get_error())


# ---- numbers a double holds ------------------------------------------------------------------
def _upto(n: int) -> str:
    """A regex of the decimal integers 0..``n`` (no leading zero)."""
    digits = str(n)
    parts = ["[0-9]" if k == 1 else f"[1-9][0-9]{{{k - 1}}}" for k in range(1, len(digits))]
    for i, ch in enumerate(digits):
        low = 1 if i == 0 and len(digits) > 1 else 0
        if int(ch) > low:
            rest = len(digits) - i - 1
            parts.append(digits[:i] + f"[{low}-{int(ch) - 1}]"
                         + (f"[0-9]{{{rest}}}" if rest else ""))
    parts.append(digits)
    return "(" + "|".join(parts) + ")"


#: the most decimal digits of a finite double's integer part (below 10^308 < 1.797e308)
MAX_DIGITS = 308
#: integer parts of up to this many digits may take a positive exponent (as many as the
#: digits leave below 10^308); longer ones only a negative one
EXPONENT_DIGITS = 18


def _finite_number() -> str:
    """A regex of the JSON numbers whose magnitude is below 10^308 (so a double holds them
    finitely): an integer part of d digits takes a positive exponent of at most 308 - d
    (leading zeros of the exponent allowed, as JSON allows them); a negative exponent, a
    fraction, are never past the range. JSON's own number allows any exponent: ``1e999``
    (and 400 digits then ``.0``) is what Python, pydantic and JavaScript read as Infinity."""
    fraction = r"(\.[0-9]+)?"
    forms = []
    for d in range(1, EXPONENT_DIGITS + 1):
        head = "(0|[1-9])" if d == 1 else f"[1-9][0-9]{{{d - 1}}}"
        forms.append(f"{head}{fraction}([eE](-[0-9]+|\\+?0*{_upto(MAX_DIGITS - d)}))?")
    forms.append(f"[1-9][0-9]{{{EXPONENT_DIGITS},{MAX_DIGITS - 1}}}{fraction}"
                 "([eE](-[0-9]+|\\+?0+))?")
    return "-?(" + "|".join(forms) + ")"


#: a Lark grammar of JSON values (compact, as :data:`JSON_OPTIONS` writes them) whose numbers
#: a double holds finitely (:func:`_finite_number`), any strings (a superset of what a schema
#: allows): the mirror each grammar's JSON is also held to (:class:`Constraint`), as
#: llguidance's JSON takes any exponent and has no option to bound it
FINITE_JSON = "\n".join([
    'fvalue: fobject | farray | FSTRING | FNUMBER | "true" | "false" | "null"',
    'fobject: "{" "}" | "{" fpair ("," fpair)* "}"',
    'fpair: FSTRING ":" fvalue',
    'farray: "[" "]" | "[" fvalue ("," fvalue)* "]"',
    r'FSTRING: /"(\\.|[^"\\])*"/',
    f"FNUMBER: /{_finite_number()}/"])


# ---- what a request asks for --------------------------------------------------------------------
@attrs.frozen
class Tool:
    """One ``tools`` entry of type ``function``."""

    name: str
    parameters: Mapping[str, Any]
    description: str | None = None
    #: OpenAI's ``function.strict``: every keyword of the parameters honoured (else a 400);
    #: otherwise keywords llguidance does not implement are ignored
    strict: bool = False


@attrs.frozen(eq=False)
class Structure:
    """A compiled grammar (llguidance's serialized form) and, for tools, what the output may
    call: the ``sampling.GrammarSpec`` of a request."""

    grammar: str
    tokenizer: Any
    vocab: int
    end_token: int
    #: the tools a response may call (empty: no tool calls are parsed)
    tools: tuple[Tool, ...] = ()
    #: tool_choice resolved: "auto", "required" or the named function ("none": no Structure)
    tool_choice: str = "none"
    #: ``tool_choice`` named the function ``tool_choice`` (which may be called "auto",
    #: "required" or "none": a name, not the mode)
    named: bool = False
    #: the grammar's mirror (its layout, each JSON value any of :data:`FINITE_JSON`'s), whose
    #: mask the grammar's is intersected with: every number finite as a double
    finite: str | None = None

    #: ``grammar``'s matcher as built when it was checked, never advanced (None: built by
    #: :meth:`start`); each generation starts from a copy of it (:func:`_copied`)
    matcher: Any = None
    #: ``finite``'s matcher, the same way
    mirror: Any = None

    def start(self) -> Constraint:
        """A generation's constraint: copies of the matchers built once for the request (one
        per choice of ``n``: a copy takes well under a millisecond, a build of a 2,000-branch
        ``anyOf`` schema's grammar a second)."""
        matcher = _copied(self.matcher) if self.matcher is not None \
            else _build(self.tokenizer, self.grammar)
        mirror = None
        if self.finite is not None:
            mirror = _copied(self.mirror) if self.mirror is not None \
                else _build(self.tokenizer, self.finite)
        return Constraint(matcher, self.vocab, self.end_token, list(self.tokenizer.eos_tokens),
                          mirror)


# ---- each grammar built once -------------------------------------------------------------------
class Abandoned(Exception):
    """The request compiling a grammar is gone (its timeout passed, its client left, the
    server stops): raised by the compile's checkpoint (``check``) between two steps. A step
    already started inside llguidance runs to its end (it has no way to stop one)."""


def go_on() -> None:
    """The checkpoint of a compile nobody abandons."""


class Checkpoint:
    """A compile's checkpoint (``check``): :meth:`stop` from any thread (the request's
    timeout passed, it was cancelled), and its next call raises :class:`Abandoned`."""

    def __init__(self) -> None:
        #: set by :meth:`stop`
        self.stopped = threading.Event()
        self.why = ""

    def stop(self, why: str) -> None:
        if not self.stopped.is_set():
            self.why = why
            self.stopped.set()

    def __call__(self) -> None:
        if self.stopped.is_set():
            raise Abandoned(self.why)


#: build each grammar once and start every generation from a copy (False: the plain path,
#: validated, built for the check, built again per generation; the differential test's other
#: side, tests/test_grammar_reuse.py)
REUSE_COMPILED = True
#: how many compiled grammars (matchers never advanced) are kept across requests, and the
#: most characters of serialized grammar they hold together (a proxy of their memory: a
#: matcher's size grows with its grammar's); the least recently used goes first
KEPT_MAX = 32
KEPT_CHARS_MAX = 8 << 20
#: guards :data:`_KEPT` and every copy of a kept matcher (a pristine matcher is only ever
#: copied, under this lock, never advanced)
_KEPT_MU = threading.Lock()
_KEPT: OrderedDict[tuple[int, str, bool], tuple[Any, Any]] = OrderedDict()
_kept_chars = 0


def _build(tokenizer: Any, grammar: str) -> Any:
    from llguidance import LLMatcher
    return LLMatcher(tokenizer, grammar, log_level=0)


def _copied(matcher: Any) -> Any:
    with _KEPT_MU:
        return matcher.deep_copy()


def forget_compiled() -> None:
    """Drop every kept grammar (tests: a compile from nothing)."""
    global _kept_chars, _schema_chars
    with _KEPT_MU:
        _KEPT.clear()
        _kept_chars = 0
        _SCHEMAS.clear()
        _schema_chars = 0


def _kept(tokenizer: Any, grammar: str, checked: bool) -> Any:
    with _KEPT_MU:
        key = (id(tokenizer), grammar, checked)
        hit = _KEPT.get(key)
        if hit is None or hit[0] is not tokenizer:
            return None
        _KEPT.move_to_end(key)
        return hit[1]


def _keep(tokenizer: Any, grammar: str, checked: bool, matcher: Any) -> None:
    global _kept_chars
    if len(grammar) > KEPT_CHARS_MAX:
        return
    with _KEPT_MU:
        key = (id(tokenizer), grammar, checked)
        if key in _KEPT:
            return
        _KEPT[key] = (tokenizer, matcher)
        _kept_chars += len(grammar)
        while len(_KEPT) > KEPT_MAX or _kept_chars > KEPT_CHARS_MAX:
            (_, gone, _), _ = _KEPT.popitem(last=False)
            _kept_chars -= len(gone)


def _matcher(grammar: str, tokenizer: Any, param: str, schema: Any = None,
             check: Callable[[], None] = go_on, admits: bool = True) -> Any:
    """``grammar``'s matcher, built once (kept across requests, :data:`KEPT_MAX`), never
    advanced: :func:`_checked`'s refusal when llguidance cannot compile it, and with
    ``admits`` :func:`_admits_a_value`'s. Until stop 67 the grammar was validated with the
    tokenizer, built for the check that it admits a value, then built again for each choice
    (a 2,000-branch ``anyOf`` schema: ~1 s each); now built once, its choices copies."""
    check()
    if not REUSE_COMPILED:  # the plain path: each step on its own, a matcher per generation
        _checked(grammar, tokenizer, param, schema)
        if admits:
            _admits_a_value(grammar, tokenizer, param)
        return None
    hit = _kept(tokenizer, grammar, admits)
    if hit is not None:
        return hit
    matcher = _build(tokenizer, grammar)
    if matcher.is_error():  # the refusal validation words (its message, the keyword named)
        _checked(grammar, tokenizer, param, schema)
        return matcher  # (validated, yet no matcher: served as before, in its error state)
    check()
    if admits:
        _admits_a_value(grammar, tokenizer, param, _copied(matcher))
    _keep(tokenizer, grammar, admits, matcher)
    return matcher


def _mirror(grammar: str, tokenizer: Any, check: Callable[[], None]) -> Any:
    """The finite mirror's matcher (not validated: built as :meth:`Structure.start` built it)."""
    check()
    if not REUSE_COMPILED:
        return None
    hit = _kept(tokenizer, grammar, False)
    if hit is not None:
        return hit
    matcher = _build(tokenizer, grammar)
    if not matcher.is_error():
        _keep(tokenizer, grammar, False, matcher)
    return matcher


@attrs.frozen
class ToolSetup:
    """What the chat template and the response need of ``tools``/``tool_choice``, whether or
    not a grammar is compiled: the tools that may be called (empty when none were given or
    ``tool_choice`` is ``"none"``) and the declarations the template lists (with "none" too,
    as vLLM does by default: the model knows them but does not call them)."""

    tools: tuple[Tool, ...] = ()
    choice: str = "none"
    #: the request's ``tools`` as given (the chat template's ``tools`` variable)
    declared: tuple[Mapping[str, Any], ...] = ()
    #: ``choice`` is the name of the function ``tool_choice`` named (a function may be
    #: called "auto", "required" or "none": it is still only that function's calls)
    named: bool = False


#: keywords whose value maps names to subschemas, and keywords whose value is a subschema or a
#: list of them (JSON Schema 2020-12 and draft-07's ``definitions``, ``dependencies``)
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas",
                "dependencies")
_SUBSCHEMAS = ("additionalProperties", "unevaluatedProperties", "propertyNames", "contains",
               "additionalItems", "unevaluatedItems", "not", "if", "then", "else", "items",
               "prefixItems", "anyOf", "oneOf", "allOf", "contentSchema")
#: keywords beside which unevaluatedProperties/Items see more than the schema's own
#: properties/items (what these evaluate counts as evaluated)
_APPLICATORS = ("allOf", "anyOf", "oneOf", "$ref", "if", "dependentSchemas", "dependencies")


def closed_schema(schema: Any, closing: bool = True) -> Any:
    """``schema`` with its objects and tuples closed as vLLM closes them: its default
    structured-output backend (xgrammar, ``strict_mode=True``) allows no property an object
    schema does not declare unless it says ``additionalProperties`` (or
    ``unevaluatedProperties``), and no item past a ``prefixItems`` tuple unless it says
    ``items``; its guidance backend's ``disable_additional_properties`` does the same for
    objects. llguidance follows JSON Schema's default (anything more is allowed), so a model
    added keys of its own until ``max_tokens`` and the answer did not parse (langchain's
    ``with_structured_output(method="function_calling")``). An object declaring
    ``properties`` or ``patternProperties`` without saying more gets
    ``"additionalProperties": false``, a ``prefixItems`` without ``items`` gets
    ``"items": false``; what a schema says (``additionalProperties: true`` or a schema) is
    kept, and an object declaring no properties (``{"type": "object"}``, ``json_object``) stays
    any object. ``unevaluatedProperties`` / ``unevaluatedItems``, which llguidance ignores
    (strict or not), become ``additionalProperties`` / ``items`` where no applicator
    (``allOf``, ``anyOf``, ``oneOf``, ``$ref``, ``if``, dependencies) sits beside them, so
    ``"unevaluatedProperties": false`` closes an object as in xgrammar.

    An ``allOf`` (OpenAPI's inheritance, ``allOf: [{"$ref": "#/$defs/Pet"}, {...}]``), or a
    ``$ref`` beside an object's own ``properties``, is closed at its parent: llguidance
    intersects the members, so a closed member would refuse the others' keys (the closed
    ``Pet`` made a required ``bark`` unsatisfiable, a 400), while open members let the model
    write keys of its own. Its members (and, within them, ``anyOf``/``oneOf`` branches) are
    left open, a ``$ref`` among them pointing to an open copy of its definition (added to the
    root's ``$defs``, once per definition; the definition stays closed where it is used
    alone), their insides closed; the parent gets the union of the keys they declare (their
    definitions' and nested members' too) and ``"additionalProperties": false``, unless it
    says otherwise (``unevaluatedProperties: false`` says the same), or a member does
    (``additionalProperties`` other than false, ``patternProperties``), or none declares a
    key. xgrammar itself answers an ``allOf`` of several members with any JSON value (a
    warning, "Support for allOf with multiple options is still ongoing") and one of one
    member as that member, closed: this keeps what a client means, the declared keys. An
    ``anyOf``/``oneOf`` beside the object's own ``properties`` (or beside
    ``unevaluatedProperties``), and an ``if`` beside ``unevaluatedProperties``, is closed the
    same way (:func:`_merging`); each ``anyOf``/``oneOf`` branch of a parent so closed allows
    its own keys and those declared beside it (:meth:`_Closer.close_branches`).

    A copy: the request's schema is left as it was. A ``pattern`` and a ``patternProperties``
    key are anchored (:func:`anchored`), as xgrammar matches them. The walk is bounded by the
    body's own nesting limit and each definition is walked once. When closing the branches
    makes a schema llguidance refuses as too large (it intersects an ``allOf``'s ``anyOf``
    members branch by branch, and closed branches are larger: two groups of 40 and 5
    branches), the branches take the parent's union instead (looser: the schema as it was
    served until stop 63)."""
    closer = _Closer(schema)
    out = closer.root(closing)
    if closer.narrowed and _too_large(out):
        return _Closer(schema, exact=False).root(closing)
    return out


def _too_large(schema: Any) -> bool:
    """Whether llguidance refuses ``schema`` as too large (False without llguidance: no
    grammar is compiled then, the request is refused naming the package)."""
    try:
        from llguidance import LLMatcher
    except ImportError:
        return False
    try:
        options: Any = {**JSON_OPTIONS, "lenient": True}  # llguidance's JsonCompileOptions
        grammar = LLMatcher.grammar_from_json_schema(schema, overrides=options)
    except ValueError:
        return False  # refused for another reason: the compile names it
    error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    return bool(error) and any("too large" in message for message in messages)


#: where the open copies of allOf members' definitions go (in the root's ``$defs``)
_OPEN_PREFIX = "open."
#: the most ``anyOf``/``oneOf`` groups of one merged parent whose branches are each closed
#: (:meth:`_Closer.close_branches`; past them a branch takes the parent's union, looser)
GROUPS_MAX = 64
#: the most combinations of branches llguidance is asked to intersect for the repeated
#: groups of ``$ref``'d definitions (it distributes an ``allOf`` over its ``anyOf`` members:
#: two groups of 10 and 5 repeated were 2,500, "schema too large")
BRANCHES_MAX = 256


def _merging(schema: dict[str, Any]) -> bool:
    """Whether ``schema`` is closed at itself on the keys its members declare
    (:meth:`_Closer.close_merged`), its members left open: an ``allOf``; a ``$ref`` beside
    its own ``properties`` or beside ``unevaluatedProperties`` (``{"$ref": "#/$defs/P",
    "unevaluatedProperties": false}``: left beside it, a 400 since stop 64); an
    ``anyOf``/``oneOf`` beside its own ``properties`` (common keys and variants: the parent
    closed on its own keys and each branch on its own refused every object holding both, a
    400 ``required property 'c' is unsatisfiable``) or beside ``unevaluatedProperties``; an
    ``if`` beside ``unevaluatedProperties``."""
    if isinstance(schema.get("allOf"), list):
        return True
    own = isinstance(schema.get("properties"), dict)
    if isinstance(schema.get("$ref"), str) and (own or "unevaluatedProperties" in schema):
        return True
    if any(isinstance(schema.get(key), list) for key in ("anyOf", "oneOf")):
        return (own or "unevaluatedProperties" in schema) \
            and not isinstance(schema.get("patternProperties"), dict)
    return "if" in schema and "unevaluatedProperties" in schema


class _Closer:
    """One :func:`closed_schema` rewrite: its root (``$ref`` pointers resolve in it), the open
    copies of the definitions made so far, and the keys each schema declares (by identity:
    every schema is looked at once however many members refer to it)."""

    def __init__(self, root: Any, exact: bool = True) -> None:
        self.given = root
        self.exact = exact  # close each anyOf/oneOf branch of a merged parent on its keys
        self.narrowed = False  # a branch was so closed
        self.opened: dict[str, str] = {}  # a $ref -> the $defs name of its open copy
        self.copies: dict[str, Any] = {}  # that name -> the open copy
        self.declared: dict[int, tuple[frozenset[str], bool]] = {}
        self.walking: set[int] = set()

    def root(self, closing: bool) -> Any:
        out = self.closed(self.given, closing)
        if self.copies and isinstance(out, dict):
            defs = out.get("$defs")
            out["$defs"] = {**(defs if isinstance(defs, dict) else {}), **self.copies}
        return out

    def closed(self, schema: Any, closing: bool = True) -> Any:
        if isinstance(schema, list):
            return [self.closed(item) for item in schema]
        if not isinstance(schema, dict):
            return schema
        merging = _merging(schema)
        out: dict[str, Any] = {}
        for key, value in schema.items():
            if key == "patternProperties" and isinstance(value, dict):
                out[key] = _anchored_keys(value, self.closed)
            elif key in _SCHEMA_MAPS and isinstance(value, dict):
                out[key] = {name: self.closed(sub) for name, sub in value.items()}
            elif key == "pattern" and isinstance(value, str):
                out[key] = anchored(LOOKAROUND_FREE.get(value) or decimal_part(value) or value)
            elif key in ("allOf", "anyOf", "oneOf") and isinstance(value, list) \
                    and (key == "allOf" or merging or not closing):
                out[key] = [self.closed(sub, closing=False) for sub in value]
            elif key == "$ref" and isinstance(value, str) and (merging or not closing):
                out[key] = self.open_ref(value)
            elif key in _SUBSCHEMAS:
                out[key] = self.closed(value)
            else:
                out[key] = value
        if "propertyNames" in out and not merging:
            self.name_keys(out)
        branches = out.get("anyOf")
        given = schema.get("anyOf")
        if isinstance(branches, list) and len(branches) == 2 and branches[0] == {"type": "number"} \
                and isinstance(branches[1], dict) and isinstance(given, list) \
                and isinstance(given[1], dict) and isinstance(given[1].get("pattern"), str) \
                and decimal_part(given[1]["pattern"]) is not None:
            # a constrained pydantic Decimal: its string form alone (a number of more places
            # or digits than it allows matched {"type": "number"}, and .parse() refused it)
            out.pop("anyOf")
            out.update(branches[1])
        if merging and closing:
            self.close_merged(schema, out)
        elif not any(key in out for key in _APPLICATORS):
            # llguidance ignores unevaluatedProperties/Items (lenient or strict alike: a
            # model's own keys followed an object that said "unevaluatedProperties": false);
            # without an applicator beside it, it means what additionalProperties / items say
            if "unevaluatedProperties" in out and "additionalProperties" not in out:
                out["additionalProperties"] = out.pop("unevaluatedProperties")
            if "unevaluatedItems" in out and "items" not in out and "additionalItems" not in out:
                out["items"] = out.pop("unevaluatedItems")
        if closing and not merging:
            if (isinstance(out.get("properties"), dict)
                    or isinstance(out.get("patternProperties"), dict)) \
                    and "additionalProperties" not in out and "unevaluatedProperties" not in out:
                out["additionalProperties"] = False
        kind = out.get("format")
        served = FORMAT_PATTERNS.get(kind) if isinstance(kind, str) and "pattern" not in out \
            else None
        if served is not None:  # (a pattern applies to strings alone, as a format does)
            out.pop("format")
            out["pattern"] = served
        if closing and isinstance(out.get("prefixItems"), list) and "items" not in out \
                and "unevaluatedItems" not in out and "additionalItems" not in out:
            out["items"] = False
        return out

    def name_keys(self, out: dict[str, Any]) -> None:
        """``propertyNames`` (which llguidance does not apply) as the keys it allows, where it
        says them in one way: an ``enum``/``const`` of strings (a pydantic ``dict[Literal[...],
        int]`` or ``dict[SomeEnum, int]``, a ``$ref`` to it) becomes those ``properties``, a
        ``pattern``, a ``format`` (``uuid``, ``date``: a pydantic ``dict[UUID, int]``) or a
        length (``dict[constr(max_length=3), int]``) one ``patternProperties`` key, each with
        the schema ``additionalProperties`` gives the other keys, and no other key allowed.
        Until stop 64 it was ignored (a model wrote keys of its own: ``.parse()`` failed);
        left as it is (a 400 naming it, :func:`_unapplied`) where it says more, where the
        object has ``patternProperties`` or ``unevaluatedProperties`` too, or where a
        declared property's name is not one it allows."""
        allowed = self.names(out["propertyNames"])
        own = out.get("properties", {})
        extra = out.get("additionalProperties", True)
        if allowed is None or not isinstance(own, dict) or "patternProperties" in out \
                or "unevaluatedProperties" in out or extra is None \
                or not all(_allows(allowed, name) for name in own):
            return
        out.pop("propertyNames")
        if extra is False:  # its declared keys alone, each allowed
            return
        value = {} if extra is True else extra
        if isinstance(allowed, list):  # one alternation (optional properties would make
            # llguidance ignore a min/maxProperties beside them: pydantic's max_length)
            names = [name for name in allowed if name not in own]
            if not names:  # its declared keys alone
                out["additionalProperties"] = False
                return
            allowed = "^(?:" + "|".join(_literal(name) for name in names) + ")$"
        out["patternProperties"] = {allowed: value}
        out["additionalProperties"] = False

    def names(self, names: Any) -> list[str] | str | None:
        """The keys a ``propertyNames`` schema allows: a list of them, or an anchored regex of
        them; None where it says them otherwise (or more than one way at once)."""
        for _ in range(8):  # a $ref to a definition (a pydantic Enum key), bounded
            if not (isinstance(names, dict) and isinstance(names.get("$ref"), str)
                    and set(names) - _ANNOTATIONS == {"$ref"}):
                break
            names = self.closed(self.resolve(names["$ref"]))
        if not isinstance(names, dict) or names.get("type", "string") != "string":
            return None
        said = {key: value for key, value in names.items()
                if key not in _ANNOTATIONS and key != "type"}
        if set(said) == {"const"}:
            said = {"enum": [said["const"]]}
        if set(said) == {"enum"} and isinstance(said["enum"], list) \
                and all(isinstance(name, str) for name in said["enum"]):
            return list(said["enum"])
        if set(said) == {"pattern"} and isinstance(said["pattern"], str):
            return said["pattern"]  # (anchored by the walk)
        if set(said) == {"format"} and said["format"] in KEY_FORMATS:
            return KEY_FORMATS[said["format"]]
        lengths = [said.get("minLength", 0), said.get("maxLength", "")]
        if said and set(said) <= {"minLength", "maxLength"} and all(
                isinstance(n, int) and not isinstance(n, bool) and 0 <= n < 2 ** 16
                for n in lengths if n != ""):
            return f"^(?s:.){{{lengths[0]},{lengths[1]}}}$"
        return None

    def close_merged(self, schema: dict[str, Any], out: dict[str, Any]) -> None:
        """Close a merged parent (:func:`_merging`) on the union of the keys its members
        declare, unless it or a member says otherwise; and each ``anyOf``/``oneOf`` branch
        among them on its own keys and those declared beside it (:meth:`close_branches`)."""
        if "additionalProperties" in out or out.get("unevaluatedProperties", False) is not False:
            return
        own = out.get("properties")
        names: set[str] = set(own) if isinstance(own, dict) else set()
        said_open = False
        enforced: set[str] = set()  # the keys a member llguidance intersects declares
        self.walking.add(id(schema))
        for member in self.members(schema):
            more, member_open = self.keys(member)
            names.update(more)
            said_open = said_open or member_open
            if not any(member is schema.get(key) for key in ("if", "then", "else")):
                enforced.update(more)
        self.walking.discard(id(schema))
        if said_open or not names:
            return
        # llguidance ignores if/then/else: a key only they declare takes one of the shapes
        # they give it (present, its branch applies: the condition's outcome is not known)
        shapes: dict[str, list[Any]] = {}
        for key in ("if", "then", "else"):
            declared = out.get(key, {}).get("properties") if isinstance(out.get(key), dict) \
                else None
            for name, shape in (declared.items() if isinstance(declared, dict) else ()):
                shapes.setdefault(name, []).append(shape)
        properties = dict(own) if isinstance(own, dict) else {}
        for name in sorted(names - set(properties)):
            given = shapes.get(name, []) if name not in enforced else []
            properties[name] = given[0] if len(given) == 1 else {"anyOf": given} if given \
                else {}
        out["properties"] = properties
        out.pop("unevaluatedProperties", None)
        out["additionalProperties"] = False
        self.close_branches(schema, out)

    def close_branches(self, schema: dict[str, Any], out: dict[str, Any]) -> None:
        """Each ``anyOf``/``oneOf`` branch of a closed merged parent allows its own keys and
        those declared beside its group (the parent's, the other members'), not the other
        branches': the parent's union alone let an object take a key of one branch with
        another branch's shape (``{"b": 1, "c": true, "a": 5}`` where ``a`` is branch A's
        string, branch B holding). A group of the parent or of an inline ``allOf`` member is
        rewritten in place (its rewrite is this parent's alone); a group in a ``$ref``'d
        definition (its open copy shared) is repeated, its branches so closed, as one more
        ``allOf`` member of the parent, unless that takes llguidance's intersection of the
        groups past :data:`BRANCHES_MAX` combinations (then its branches take the union)."""
        if isinstance(schema.get("patternProperties"), dict) or not self.exact:
            return  # its keys are the parent's too: each branch takes the parent's union
        found = self.groups(schema, out)
        combinations = math.prod(len(group) for group, _, _ in found)
        extra: list[Any] = []
        for group, holder, key in found:
            beside = self.keys_beside(schema, group)
            if holder is not None:
                holder[key] = [self.only(done, branch, beside)
                               for branch, done in zip(group, holder[key])]
            elif combinations * len(group) <= BRANCHES_MAX:
                combinations *= len(group)
                extra.append({"anyOf": [self.only(self.closed(branch, closing=False), branch,
                                                  beside) for branch in group]})
        if extra:
            members = out.get("allOf")
            out["allOf"] = [*(members if isinstance(members, list) else []), *extra]

    def groups(self, schema: dict[str, Any], out: dict[str, Any]
               ) -> list[tuple[list[Any], dict[str, Any] | None, str]]:
        """The ``anyOf``/``oneOf`` lists a merged parent's value must satisfy one branch of:
        its own and those of its ``allOf`` members and ``$ref``'d definitions, theirs too, not
        those within a branch; each as (the list as given, the rewrite holding it and its key,
        or None for a definition's: its open copy is shared). Bounded: at most
        :data:`GROUPS_MAX`, each schema looked at once."""
        found: list[tuple[list[Any], dict[str, Any] | None, str]] = []
        seen: set[int] = set()
        todo: list[tuple[Any, Any]] = [(schema, out)]
        while todo and len(found) < GROUPS_MAX:
            node, done = todo.pop(0)
            if not isinstance(node, dict) or id(node) in seen:
                continue
            seen.add(id(node))
            holder = done if isinstance(done, dict) else None
            for key in ("anyOf", "oneOf"):
                if isinstance(node.get(key), list):
                    ours = holder is not None and isinstance(holder.get(key), list) \
                        and len(holder[key]) == len(node[key])
                    found.append((node[key], holder if ours else None, key))
            members = node.get("allOf")
            if isinstance(members, list):
                rewritten = holder.get("allOf") if holder is not None else None
                todo.extend((member, rewritten[i] if isinstance(rewritten, list)
                             and i < len(rewritten) else None)
                            for i, member in enumerate(members))
            if isinstance(node.get("$ref"), str):
                todo.append((self.resolve(node["$ref"]), None))
        return found[:GROUPS_MAX]

    def keys_beside(self, schema: dict[str, Any], group: list[Any]) -> frozenset[str]:
        """The keys ``schema`` declares (its own, its members', their definitions') but for
        those only ``group``'s branches declare."""
        names: set[str] = set()
        seen: set[int] = set()
        todo: list[Any] = [schema]
        while todo:
            node = todo.pop()
            if not isinstance(node, dict) or id(node) in seen:
                continue
            seen.add(id(node))
            properties = node.get("properties")
            if isinstance(properties, dict):
                names.update(properties)
            for key in ("allOf", "anyOf", "oneOf"):
                if isinstance(node.get(key), list) and node[key] is not group:
                    todo.extend(node[key])
            todo.extend(node.get(key) for key in ("if", "then", "else"))
            if isinstance(node.get("$ref"), str):
                todo.append(self.resolve(node["$ref"]))
        return frozenset(names)

    def only(self, branch: Any, given: Any, beside: frozenset[str]) -> Any:
        """``branch`` (its open rewrite) allowing no key but its own and ``beside``; as it
        is when ``given`` says other keys are allowed or is no schema object."""
        names, said_open = self.keys(given)
        if said_open or not isinstance(branch, dict) or not isinstance(given, dict):
            return branch
        self.narrowed = True
        own = branch.get("properties")
        properties = dict(own) if isinstance(own, dict) else {}
        for name in sorted((names | beside) - set(properties)):
            properties[name] = {}
        # beside its own keywords (llguidance intersects them with its members and $ref)
        return {**branch, "properties": properties, "additionalProperties": False}

    def keys(self, schema: Any) -> tuple[frozenset[str], bool]:
        """(the keys ``schema`` declares, its own and its members', whether one of them says
        other keys are allowed) as given, each schema looked at once (a cycle adds nothing)."""
        if not isinstance(schema, dict) or id(schema) in self.walking:
            return frozenset(), False
        if id(schema) in self.declared:
            return self.declared[id(schema)]
        self.walking.add(id(schema))
        names: set[str] = set()
        properties = schema.get("properties")
        if isinstance(properties, dict):
            names.update(properties)
        said_open = bool(schema.get("patternProperties")) or any(
            key in schema and schema[key] is not False
            for key in ("additionalProperties", "unevaluatedProperties"))
        for member in self.members(schema):
            more, member_open = self.keys(member)
            names.update(more)
            said_open = said_open or member_open
        self.walking.discard(id(schema))
        found = frozenset(names), said_open
        self.declared[id(schema)] = found
        return found

    def members(self, schema: dict[str, Any]) -> list[Any]:
        """What ``schema``'s value must also be: its ``allOf``/``anyOf``/``oneOf`` members,
        its ``if``/``then``/``else`` (which llguidance ignores: their keys are declared keys
        all the same) and what its ``$ref`` points to."""
        found: list[Any] = []
        for key in ("allOf", "anyOf", "oneOf"):
            if isinstance(schema.get(key), list):
                found.extend(schema[key])
        found.extend(schema[key] for key in ("if", "then", "else") if key in schema)
        if isinstance(schema.get("$ref"), str):
            found.append(self.resolve(schema["$ref"]))
        return found

    def resolve(self, ref: str) -> Any:
        """The schema a local ``$ref`` (``#/$defs/Pet``) points to in the root, else None."""
        if not ref.startswith("#/"):
            return None
        node = self.given
        for part in ref[2:].split("/"):
            part = urllib.parse.unquote(part).replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return None
        return node

    def open_ref(self, ref: str) -> str:
        """A ``$ref`` to an open copy of what ``ref`` points to (made once, in the root's
        ``$defs``), or ``ref`` itself where it points to nothing here (llguidance names it)."""
        if ref in self.opened:
            return self.opened[ref]
        target = self.resolve(ref)
        if not isinstance(target, dict) or not isinstance(self.given, dict):
            return ref
        defs = self.given.get("$defs")
        taken = set(defs) if isinstance(defs, dict) else set()
        base = _OPEN_PREFIX + (re.sub(r"[^A-Za-z0-9_.-]", "_", ref.rsplit("/", 1)[-1]) or "_")
        name, n = base, 1
        while name in taken or name in self.copies:
            n += 1
            name = f"{base}.{n}"
        self.opened[ref] = f"#/$defs/{name}"
        self.copies[name] = None  # taken (a definition inheriting itself refers to its copy)
        self.copies[name] = self.closed(target, closing=False)
        return self.opened[ref]


#: patterns clients write with a look-around (which llguidance's regexes do not implement: "regex
#: parse error ... look-around, including look-ahead and look-behind, is not supported") and
#: the same language without one. pydantic v2 writes the first for every ``Decimal`` field
#: (``anyOf: [{"type": "number"}, {"type": "string", "pattern": ...}]``, its
#: ``model_json_schema()``): until stop 64 every model with a ``Decimal`` field (a price) was
#: a 400, under ``.parse()``, Instructor, langchain alike. "Not only signs and dots" is "a
#: digit somewhere": an integer part of one digit or more, or none and a fraction of one
#: digit or more (``0*\d*`` is ``\d*``).
LOOKAROUND_FREE = {
    r"^(?!^[-+.]*$)[+-]?0*\d*\.?\d*$": r"^[+-]?(?:\d+\.?\d*|\.\d+)$",
}


_YEAR = "(000[1-9]|00[1-9][0-9]|0[1-9][0-9]{2}|[1-9][0-9]{3})"  # 0001-9999
_LEAP = "([0-9]{2}(0[48]|[2468][048]|[13579][26])|(0[48]|[2468][048]|[13579][26])00)"
_DATE = (f"({_YEAR}-((0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])|(0[469]|11)-(0[1-9]|[12][0-9]|30)"
         f"|02-(0[1-9]|1[0-9]|2[0-8]))|{_LEAP}-02-29)")
_TIME = r"([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\.[0-9]+)?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
#: RFC 3339's ``date``, ``date-time`` and ``time`` as patterns a grammar follows (``format``
#: replaced, where no ``pattern`` is given): llguidance's own formats allowed February 29th of
#: every year (``"2023-02-29"``, which RFC 3339, JSON Schema validators and pydantic refuse)
#: and year 0000, and the forms RFC 3339 allows that Python's ``datetime`` and pydantic refuse
#: (a lowercase ``t``/``z``, a leap second ``:60``): until stop 64 a pydantic model with a
#: ``datetime`` field failed ``.parse()`` on one answer in five of the synthetic model's
#: (``"5279-11-24t23:18:60-12:25"``). These allow a part of what the format allows, each
#: value one every parser reads: ``T`` and ``Z`` in capitals, seconds 00-59, years from 0001.
FORMAT_PATTERNS = {
    "date": f"^{_DATE}$",
    "date-time": f"^{_DATE}T{_TIME}$",
    "time": f"^{_TIME}$",
}


#: formats a ``propertyNames`` may give its keys (pydantic's ``dict[UUID, ...]``): the
#: patterns of :data:`FORMAT_PATTERNS` (which the walk already put in place of theirs) and
#: RFC 4122's UUID
KEY_FORMATS = {"uuid": "^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-"
                       "[0-9a-fA-F]{12}$"}
#: keywords that say nothing of a value (a ``propertyNames`` schema may carry them)
_ANNOTATIONS = frozenset({"title", "description", "$comment", "examples", "default",
                          "deprecated", "readOnly", "writeOnly"})


def _literal(text: str) -> str:
    """``text`` as a regex of itself (its metacharacters escaped; nothing else is, as
    llguidance's regexes refuse some escapes Python's ``re.escape`` writes)."""
    return "".join("\\" + char if char in "\\.^$|?*+()[]{}" else char for char in text)


def _allows(allowed: list[str] | str, name: str) -> bool:
    """Whether ``name`` is a key ``allowed`` (:meth:`_Closer.names`) allows."""
    if isinstance(allowed, list):
        return name in allowed
    try:
        return re.search(allowed, name) is not None
    except re.error:  # a regex llguidance reads and Python's re does not: not rewritten
        return False


#: pydantic's pattern of a ``Decimal`` with ``max_digits`` and/or ``decimal_places``
#: (``condecimal(max_digits=10, decimal_places=2)``: a price), look-aheads and all
_PYDANTIC_DECIMAL = re.compile(
    r"\^\(\?!\^\[-\+\.\]\*\$\)\[\+-\]\?0\*(?:"
    r"\(\?:\\d\{0,(?P<ip>\d+)\}\|\(\?=\[\\d\.\]\{1,(?P<md>\d+)\}0\*\$\)"
    r"\\d\{0,(?P<ip2>\d+)\}\\\.\\d\{0,(?P<dp>\d+)\}0\*\$\)"
    r"|\(\?:\\d\{0,(?P<md2>\d+)\}\|\(\?=\[\\d\.\]\{1,(?P<md3>\d+)\}0\*\$\)"
    r"\\d\*\\\.\\d\*0\*\$\)"
    r"|\\d\*\\\.\?\\d\{0,(?P<dp2>\d+)\}0\*\$)")


def decimal_part(pattern: str) -> str | None:
    """A regex without look-around of a part of what pydantic's pattern of a constrained
    ``Decimal`` allows (None for any other pattern): at most ``max_digits`` digits, at most
    ``decimal_places`` after the point, a digit somewhere, no leading zeros beyond the digits
    counted, no trailing point. A grammar may allow less than the schema (every answer still
    matches it): until stop 64 any model with such a field was a 400."""
    found = _PYDANTIC_DECIMAL.fullmatch(pattern)
    if found is None:
        return None
    sign = "^[+-]?(?:"
    if found["dp"] is not None:  # max_digits and decimal_places
        whole, places = int(found["ip"]), int(found["dp"])
        if int(found["ip2"]) != whole or whole + places + 1 != int(found["md"]) or places < 1:
            return None
        forms = ([f"[0-9]{{1,{whole}}}"] if whole else []) \
            + [f"[0-9]{{0,{whole}}}\\.[0-9]{{1,{places}}}"]
    elif found["md2"] is not None:  # max_digits alone
        digits = int(found["md2"])
        if int(found["md3"]) != digits + 1 or not 1 <= digits <= 64:
            return None
        forms = [f"[0-9]{{1,{digits}}}"] + [f"[0-9]{{{i}}}\\.[0-9]{{1,{digits - i}}}"
                                              for i in range(digits)]
    else:  # decimal_places alone
        places = int(found["dp2"])
        if places < 1:
            return None
        forms = ["[0-9]+", f"[0-9]*\\.[0-9]{{1,{places}}}"]
    return sign + "|".join(forms) + ")$"


def anchored(pattern: str) -> str:
    """A schema's ``pattern`` matched against the whole string, as vLLM's default backend
    matches it (xgrammar converts the regex to a grammar of the whole string, a leading ``^``
    and a trailing ``$`` dropped); llguidance follows JSON Schema (a match anywhere in the
    string), so ``"[a-z]+"`` was answered ``"Y'wV}x4.us"``. ``^(?:pattern)$``: the same
    language as xgrammar's for an anchored pattern or not (``^a|b$`` is ``a`` or ``b``, ``""``
    the empty string alone). A pattern whose parentheses or classes do not close (``a)(b``,
    ``[a-``: no regex) is left as it is, so llguidance still refuses it rather than the
    wrapping making it one."""
    depth, i, in_class = 0, 0, False
    while i < len(pattern):
        char = pattern[i]
        if char == "\\":
            i += 2
            continue
        if in_class:
            in_class = char != "]"
        elif char == "[":
            in_class = True
            if pattern[i + 1:i + 2] == "^":
                i += 1
            if pattern[i + 1:i + 2] == "]":
                i += 1  # a "]" first in a class is one of its characters
        elif char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
            if depth < 0:
                return pattern
        i += 1
    return pattern if depth or in_class else f"^(?:{pattern})$"


def _anchored_keys(properties: Mapping[str, Any],
                   close: Callable[[Any], Any]) -> dict[str, Any]:
    """``patternProperties`` with each key anchored: xgrammar matches a key's pattern against
    the whole key, as it does a ``pattern`` (two keys never anchor alike); each subschema
    through ``close`` (the rewrite's own :meth:`_Closer.closed`)."""
    return {anchored(key): close(sub) for key, sub in properties.items()}


#: the numbers llguidance 1.9.1 takes in a schema: past u64 and i64 it says "Value is not
#: JSON serializable" (which the client's valid JSON is not), and a number at or below
#: -2^63+1024 (``{"const": -9223372036854775808}``, in an ``enum`` or a nested ``const``;
#: ``{"type": "integer", "const": -1e30}``; an integer range below it) crashed the whole
#: server process (SIGSEGV in its grammar compiler); within them it reads a number as a
#: double, so only the integers a double holds are kept as written
INT_LOW, INT_HIGH = -(2 ** 63) + 2 ** 11, 2 ** 64


def _takes(value: int) -> bool:
    """Whether llguidance keeps the integer ``value`` of a schema as written."""
    return INT_LOW <= value < INT_HIGH and float(value) == value


def _finite(schema: Any, param: str) -> None:
    """Refuse a number in ``schema`` that is not finite: the body's parser reads ``1e400`` as
    Infinity (and takes ``NaN``, ``Infinity``), which llguidance's JSON writes as ``null``, so
    ``{"const": 1e400}`` was a grammar of ``null`` and the answer ``null`` with
    ``finish_reason: stop``, a value the schema never allowed (``maximum: 1e400`` a 400 saying
    "got null"). Likewise an integer llguidance cannot take as written (``"maxItems":
    10**30``, refused as "Value is not JSON serializable: 1000...", no place named;
    ``{"const": -2**63}`` crashed the server process; ``{"const": 2**53 + 1}`` was answered
    ``9007199254740992``). The walk is bounded by the body's own nesting limit."""
    todo: list[tuple[str, Any]] = [(param, schema)]
    while todo:
        where, value = todo.pop()
        if isinstance(value, float) and not math.isfinite(value):
            raise GrammarError(param, f"{where}={shown(value)}: not a finite number (a number "
                                      "past a double's range, such as 1e400, reads as "
                                      "Infinity): a JSON Schema needs finite numbers")
        if isinstance(value, float) and abs(value) >= 10.0 ** MAX_DIGITS \
                and (".const" in where or ".enum[" in where):  # a value the answer writes
            raise GrammarError(param, f"{where}={shown(value)}: a number of 10^308 or more in "
                                      "size, which no answer writes (every number written is "
                                      "below 10^308, so that a double holds it): write a "
                                      "smaller one, or leave it out")
        if isinstance(value, float) and value < INT_LOW:
            raise GrammarError(param, f"{where}={shown(value)}: a number llguidance cannot "
                                      "take (below -2^63+2048: as an integer's const or "
                                      "range bound it crashed llguidance's grammar compiler, "
                                      "as a number's range bound it cannot compile it): "
                                      "write a larger one, or leave it out")
        if isinstance(value, int) and not isinstance(value, bool) and not _takes(value):
            if value < INT_LOW:  # -2**70 is a double: the doubles are not why
                why, fix = ("below -2^63+2048: as a const, an enum member or a range bound "
                            "it crashed llguidance's grammar compiler"), "a larger one"
            elif value >= INT_HIGH:
                why, fix = "2^64 or more: past its 64-bit integers", "a smaller one"
            else:
                why, fix = ("it reads a schema's numbers as doubles, from -2^63+2048 to "
                            "2^64: 9007199254740993 became 9007199254740992, a value the "
                            "schema did not allow"), "one a double holds"
            raise GrammarError(param, f"{where}={shown(value)}: an integer llguidance cannot "
                                      f"take as written ({why}): write {fix}, or leave it out")
        if isinstance(value, int) and not isinstance(value, bool) and value > INT64_MAX \
                and (".const" in where or ".enum[" in where) \
                and (written := decimal.Decimal(repr(float(value)))) != value:
            raise GrammarError(param, f"{where}={shown(value)}: an integer llguidance writes as "
                                      f"{int(written)}, another number (from 2^63 up it writes a "
                                      "value of no integer type as a double's shortest digits: "
                                      "9223372036854775808 was answered 9223372036854776000, "
                                      "a value the schema does not allow): write one whose "
                                      "digits a double's shortest form keeps "
                                      "(10000000000000000000), or leave it out")
        if isinstance(value, dict):
            todo.extend((f"{where}.{key}", item) for key, item in value.items())
        elif isinstance(value, list):
            todo.extend((f"{where}[{i}]", item) for i, item in enumerate(value))


#: llguidance 1.9.1 holds an integer's range (and an integer ``const``/``enum``, which it
#: writes as one) in 64-bit signed integers, capping a bound at 2^63-1 without a word
INT64_MAX = 2 ** 63 - 1


#: keywords whose subschemas apply to the same value as the schema holding them (their type
#: may come from it)
_SAME_VALUE = frozenset({"allOf", "anyOf", "oneOf", "not", "if", "then", "else",
                         "dependentSchemas", "dependencies"})


def _integer_bounds(schema: Any, param: str) -> None:
    """Refuse a bound of an integer llguidance caps at 2^63-1 (:data:`INT64_MAX`): ``{"type":
    "integer", "const": 9223372036854775808}`` (an ``enum`` member, a ``minimum``, an
    ``exclusiveMinimum`` of 2^63-1 alike; ``1e19`` as a float too) was answered
    ``9223372036854775807``, ``finish_reason: stop``, a value the schema does not allow, and a
    ``maximum`` of 2^64-1 (an unsigned 64-bit range) served half its range. A node says it may
    be an integer by its ``type``; a node of no ``type`` (or ``"number"``) may be one where its
    type comes from the same value's other schemas: a parent's ``type`` over its
    ``allOf``/``anyOf``/``oneOf`` members, an ``allOf`` member beside it (``{"allOf": [{"type":
    "integer"}, {"const": 1e19}]}``), a ``$ref`` beside it or a definition (which a ``$ref``
    may reach from anywhere) where the schema declares an integer anywhere. Until stop 64 any
    node of no ``type`` counted where the schema declared an integer anywhere: ``{"properties":
    {"n": {"type": "integer"}, "big": {"const": 10000000000000000000}}}`` was a 400, though
    llguidance writes that const as given (a property's value takes no type from its
    neighbours). An integer from 2^64 up is left to :func:`_finite` (llguidance cannot take it
    at all). The walk is bounded by the body's own nesting limit; values (``const``, ``enum``,
    ``default``, ``examples``) are not walked as schemas."""
    integers = '"integer"' in json.dumps(schema)
    # (where, node, its type may come from elsewhere: a parent, an allOf member, a $ref)
    todo: list[tuple[str, Any, bool]] = [(param, schema, False)]
    while todo:
        where, node, inherited = todo.pop()
        if isinstance(node, list):
            todo.extend((f"{where}[{i}]", item, inherited) for i, item in enumerate(node))
            continue
        if not isinstance(node, dict):
            continue
        types = node.get("type")
        kinds = types if isinstance(types, list) else [types]
        members = node.get("allOf")
        beside = isinstance(members, list) and any('"integer"' in json.dumps(member)
                                                   for member in members)
        inherited = inherited or beside or ("$ref" in node and integers)
        same = inherited or "integer" in kinds  # what its members' type may come from
        for key, item in node.items():
            if key in VALUE_KEYS:
                continue
            # a definition is reached by a $ref from anywhere; another value (a property's,
            # an item's) has its own type
            flag = integers if key in ("$defs", "definitions") else \
                same if key in _SAME_VALUE else False
            if key in _SCHEMA_MAPS and isinstance(item, dict):  # names -> schemas
                todo.extend((f"{where}.{key}.{name}", sub, flag) for name, sub in item.items())
            else:
                todo.append((f"{where}.{key}", item, flag))
        if "integer" in kinds or ((types is None or "number" in kinds) and inherited):
            found = [(key, node[key], INT64_MAX - (key == "exclusiveMinimum")
                      + (key == "exclusiveMaximum"))
                     for key in ("const", "minimum", "maximum", "exclusiveMinimum",
                                 "exclusiveMaximum") if key in node]
            members = node.get("enum")
            if isinstance(members, list):
                found.extend((f"enum[{i}]", value, INT64_MAX) for i, value in enumerate(members))
            for key, value, most in found:
                if isinstance(value, (int, float)) and not isinstance(value, bool) \
                        and math.isfinite(value) and most < value \
                        and not (isinstance(value, int) and value >= INT_HIGH):  # _finite's
                    raise GrammarError(param, f"{where}.{key}={shown(value)}: an integer bound "
                                              "llguidance caps at 2^63-1 (it holds an "
                                              "integer's range, const and enum in 64-bit "
                                              "signed integers: a const of "
                                              "9223372036854775808 was answered "
                                              "9223372036854775807, a value the schema does "
                                              "not allow): write one of at most "
                                              "9223372036854774784 (the largest integer "
                                              "below 2^63 a double holds), or leave it out")


def _admits_a_value(grammar: str, tokenizer: Any, param: str, matcher: Any = None) -> str:
    """Refuse a schema whose grammar can only end at once (a ``$ref`` that refers only to
    itself, or to a cycle of such): no JSON value satisfies it, and llguidance's first mask
    allows only its end token, so the answer was empty text with ``finish_reason: stop``, as
    if all went well (with tools, the answer left out and the model sent to call one)."""
    from llguidance import LLMatcher
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask
    if matcher is None:
        matcher = LLMatcher(tokenizer, grammar, log_level=0)
    if matcher.is_accepting() or matcher.is_error():
        return grammar
    bits = allocate_token_bitmask(1, tokenizer.vocab_size)
    fill_next_token_bitmask(matcher, bits)
    words = bits[0].view(np.uint32).copy()
    for token in tokenizer.eos_tokens:
        if 0 <= token < tokenizer.vocab_size:
            words[token // 32] &= ~np.uint32(1 << (token % 32))
    if not words.any():
        raise GrammarError(param, f"{param}: no JSON value satisfies it (its grammar can only "
                                  "end before any text: a $ref that refers only to itself, "
                                  "or to a cycle of such, defines no value)")
    return grammar


#: the grammar of each JSON Schema that passed :func:`_schema_grammar`'s checks, by the
#: schema's JSON text and ``strict`` (least recently used first, bounded as :data:`_KEPT`:
#: :data:`KEPT_MAX` schemas, :data:`KEPT_CHARS_MAX` characters of schema and grammar
#: together), so a request of a schema seen before skips the checks and the two compiles
#: its compiled grammar (kept in :data:`_KEPT`) skips. A refused schema is not kept: it is
#: checked again (and refused in the same words). Guarded by :data:`_KEPT_MU`.
_SCHEMAS: OrderedDict[tuple[str, bool], str] = OrderedDict()
_schema_chars = 0


def _schema_key(schema: Any, strict: bool) -> tuple[str, bool] | None:
    """``schema``'s key in :data:`_SCHEMAS`: its JSON text, keys in their order (the
    grammar follows it) and numbers as written (``1`` and ``1.0`` apart); None when it has
    no JSON text or is too long to keep."""
    try:
        text = json.dumps(schema, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError):
        return None
    return None if len(text) > KEPT_CHARS_MAX else (text, strict)


def _schema_grammar(schema: Any, param: str, strict: bool) -> str:
    """:func:`_checked_schema_grammar` of ``schema``, kept across requests
    (:data:`_SCHEMAS`; the plain path, ``REUSE_COMPILED`` False, checks every time)."""
    global _schema_chars
    key = _schema_key(schema, strict) if REUSE_COMPILED else None
    if key is None:
        return _checked_schema_grammar(schema, param, strict)
    with _KEPT_MU:
        grammar = _SCHEMAS.get(key)
        if grammar is not None:
            _SCHEMAS.move_to_end(key)
            return grammar
    grammar = _checked_schema_grammar(schema, param, strict)
    with _KEPT_MU:
        if key not in _SCHEMAS and len(key[0]) + len(grammar) <= KEPT_CHARS_MAX:
            _SCHEMAS[key] = grammar
            _schema_chars += len(key[0]) + len(grammar)
            while len(_SCHEMAS) > KEPT_MAX or _schema_chars > KEPT_CHARS_MAX:
                (text, _), gone = _SCHEMAS.popitem(last=False)
                _schema_chars -= len(text) + len(gone)
    return grammar


def _checked_schema_grammar(schema: Any, param: str, strict: bool) -> str:
    """``schema``'s grammar after its checks (integer bounds, finite numbers, keywords
    llguidance would not apply), or the :class:`GrammarError` naming ``param``."""
    from llguidance import LLMatcher
    if not isinstance(schema, dict):
        raise GrammarError(param, f"{param}={shown(schema, 80)}: must be a JSON Schema, a "
                                  "JSON object (such as {\"type\": \"object\"})")
    _integer_bounds(schema, param)
    _finite(schema, param)
    try:
        lenient: Any = {**JSON_OPTIONS, "lenient": True}  # llguidance's JsonCompileOptions
        grammar = LLMatcher.grammar_from_json_schema(schema, overrides=lenient)
    except ValueError as err:
        raise GrammarError(param, f"{param}: llguidance cannot compile it: {err}") from None
    _unapplied(grammar, schema, param, strict)  # (lenient compiles name them)
    if not strict:
        return grammar
    try:
        options: Any = {**JSON_OPTIONS, "lenient": False}
        return LLMatcher.grammar_from_json_schema(schema, overrides=options)
    except ValueError as err:
        raise GrammarError(param, f"{param}: llguidance cannot compile it: {err}") from None


#: how llguidance 1.9.1 names, among a lenient compile's warnings, the keywords it ignored
UNIMPLEMENTED = "Unimplemented keys: "
#: what to write instead of a keyword llguidance does not apply (said in the refusal)
INSTEAD = {
    "if": "write the cases as anyOf branches, each with the properties it requires",
    "then": "write the cases as anyOf branches, each with the properties it requires",
    "else": "write the cases as anyOf branches, each with the properties it requires",
    "uniqueItems": "a pydantic set[...] or frozenset[...] field writes it: declare a list",
    "dependentSchemas": "write the cases as anyOf branches",
    "dependentRequired": "write the cases as anyOf branches",
    "dependencies": "write the cases as anyOf branches",
}


#: keywords served without ``strict`` though llguidance does not apply them: ``uniqueItems``
#: is what a pydantic ``set[...]``/``frozenset[...]`` field writes, and pydantic reads a
#: list holding duplicates into that set (``.parse()`` and LangChain's structured output
#: answer right); refusing it broke every such model without ``strict`` (served until stop
#: 64, documented as not applied). With ``strict`` it is refused, naming its place.
LENIENT_SERVED = frozenset({"uniqueItems"})


def _unapplied(grammar: str, schema: dict[str, Any], param: str, strict: bool) -> None:
    """Refuse a schema holding a keyword llguidance does not apply (its lenient compile
    names them among its warnings: ``if``/``then``/``else``, ``not``, ``uniqueItems``,
    ``contains``, ``propertyNames``, ``dependentSchemas``, ``dependentRequired``,
    ``unevaluatedProperties`` beside an applicator :func:`closed_schema` cannot rewrite...),
    naming the keyword and its JSON pointer. Until stop 64 such a keyword was ignored
    without a word unless ``strict`` was true (and then the 400 named no place): ``{"if":
    {"properties": {"kind": {"const": "a"}}}, "then": {"required": ["x"]}}`` was answered
    ``{"kind":"a"}``, and ``"uniqueItems": true`` ``[1,1]``, answers that do not validate
    against the schema. llguidance implements no ``not`` either, so a conditional cannot be
    rewritten as ``anyOf: [{allOf: [if, then]}, {allOf: [{not: if}, else]}]``: it is
    refused, as OpenAI's strict mode refuses a keyword it does not support."""
    from llguidance import LLMatcher
    _, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    keys: list[str] = []
    for message in messages:
        if message.startswith(UNIMPLEMENTED):
            try:
                named = json.loads(message[len(UNIMPLEMENTED):])
            except ValueError:
                named = [message[len(UNIMPLEMENTED):]]
            keys.extend(str(key) for key in (named if isinstance(named, list) else [named]))
    if any(message.startswith(ONE_OF_AS_ANY) for message in messages):
        pointer = _one_of_place(schema)
        raise GrammarError(param, f"{param}: \"oneOf\" at {pointer} (a JSON pointer into the "
                                  "schema) has branches llguidance cannot tell apart (a value "
                                  "may match two: 4 matches both {\"type\": \"number\"} and "
                                  "{\"type\": \"integer\"}; [] both arrays), so it would be "
                                  "served as anyOf and an answer could match two branches, "
                                  "which oneOf refuses: write anyOf if a value may match "
                                  "several, or give the branches a property of different "
                                  "consts (a discriminator) or different types")
    if any(message.startswith(COUNT_IGNORED) for message in messages):
        key, pointer = _count_place(schema)
        raise GrammarError(param, f"{param}: {json.dumps(key)} at {pointer} (a JSON pointer into "
                              "the schema) beside optional properties: llguidance applies "
                              "minProperties/maxProperties only where every property in "
                              "\"properties\" is required, and would ignore it (an answer "
                              "could hold more or fewer keys): make those properties "
                              "required, or leave the bound out")
    if not strict:
        keys = [key for key in keys if key not in LENIENT_SERVED]
    if not keys:
        return
    key, pointer = _keyword_place(schema, keys)
    instead = INSTEAD.get(key)
    raise GrammarError(param, f"{param}: {json.dumps(key)} at {pointer or '/'} (a JSON "
                              "pointer into the schema) is a keyword llguidance, which "
                              "compiles the schema to a grammar, does not apply: an answer "
                              "could break it, so the schema is refused (as OpenAI's strict "
                              f"mode refuses it); leave it out"
                              + (f" ({instead})" if instead else ""))


#: how llguidance 1.9.1 says, among a lenient compile's warnings, that it served a ``oneOf``
#: as ``anyOf`` (it could not prove its branches disjoint)
ONE_OF_AS_ANY = "oneOf not fully supported, falling back to anyOf"


#: how llguidance 1.9.1 says, among a lenient compile's warnings, that it ignored a
#: ``minProperties``/``maxProperties`` (beside properties not all required)
COUNT_IGNORED = "min/maxProperties only supported when all keys listed"


def _count_place(schema: dict[str, Any]) -> tuple[str, str]:
    """(the keyword, the JSON pointer) of the first ``minProperties``/``maxProperties``
    (breadth first) beside ``properties`` not all ``required``."""
    for where, node in _schema_nodes(schema):
        own = node.get("properties")
        required = node.get("required")
        if isinstance(own, dict) and not set(own) <= set(
                required if isinstance(required, list) else []):
            for key in ("minProperties", "maxProperties"):
                if key in node:
                    return key, f"{where}/{key}"
    return "maxProperties", "/"


def _one_of_place(schema: dict[str, Any]) -> str:
    """The JSON pointer of the first ``oneOf`` (breadth first) llguidance serves as
    ``anyOf``, compiled alone with the root's definitions (else the first ``oneOf`` found)."""
    from llguidance import LLMatcher
    defs = {key: schema[key] for key in ("$defs", "definitions") if key in schema}
    first = None
    for where, node in _schema_nodes(schema):
        if isinstance(node.get("oneOf"), list):
            first = first or f"{where}/oneOf"
            try:
                alone: Any = {**defs, **node}
                options: Any = {**JSON_OPTIONS, "lenient": True}  # JsonCompileOptions
                grammar = LLMatcher.grammar_from_json_schema(alone, overrides=options)
                _, messages = LLMatcher.validate_grammar_with_warnings(grammar)
            except ValueError:
                messages = []
            if any(message.startswith(ONE_OF_AS_ANY) for message in messages) and not \
                    any(isinstance(sub, dict) and "oneOf" in json.dumps(sub)
                        for sub in node["oneOf"]):  # (an inner oneOf may be the one)
                return f"{where}/oneOf"
    return first or "/"


def _keyword_place(schema: Any, keys: Sequence[str]) -> tuple[str, str]:
    """(the first of ``keys`` found as a keyword of a schema in ``schema``, breadth first,
    and the JSON pointer of the schema holding it), else (the first key, ""). Only schemas
    are looked at (a property named ``if`` is a name, a ``const`` a value), not the open
    copies :func:`closed_schema` adds to ``$defs`` (their originals are walked); the walk is
    bounded by the body's own nesting limit."""
    wanted = set(keys)
    for where, node in _schema_nodes(schema):
        for key in node:
            if key in wanted:
                return key, f"{where}/{_escaped(key)}"
    return keys[0], ""


def _schema_nodes(schema: Any) -> Iterator[tuple[str, dict[str, Any]]]:
    """Each schema object in ``schema``, breadth first, with its JSON pointer: the subschemas
    of the applicators and maps (``_SUBSCHEMAS``, ``_SCHEMA_MAPS``), not values (a property
    named ``if`` is a name, a ``const`` a value), nor the open copies :func:`closed_schema`
    adds to ``$defs`` (their originals are walked); bounded by the body's nesting limit."""
    todo: deque[tuple[str, Any]] = deque([("", schema)])
    while todo:
        where, node = todo.popleft()
        if not isinstance(node, dict):
            continue
        yield where, node
        for key, value in node.items():
            at = f"{where}/{_escaped(key)}"
            if key in _SCHEMA_MAPS and isinstance(value, dict):
                todo.extend((f"{at}/{_escaped(name)}", sub) for name, sub in value.items()
                            if not (key == "$defs" and name.startswith(_OPEN_PREFIX)))
            elif key in _SUBSCHEMAS and isinstance(value, list):
                todo.extend((f"{at}/{i}", sub) for i, sub in enumerate(value))
            elif key in _SUBSCHEMAS:
                todo.append((at, value))


def _escaped(name: str) -> str:
    """``name`` as a JSON pointer's reference token (RFC 6901)."""
    return name.replace("~", "~0").replace("/", "~1")


#: a schema's range keywords, and the keywords whose value is a JSON value, not a schema
RANGE_KEYS = ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum")
LENGTH_KEYS = ("minLength", "maxLength")
VALUE_KEYS = frozenset({"const", "enum", "default", "examples"})
#: how llguidance 1.9.1 says it could not write a number a keyword gives (a range, a
#: ``multipleOf``, a string's length), naming neither the keyword's place nor, for a length,
#: the keyword
NUMBER_FAILED = ("Failed to generate regex for", "Value for 'multipleOf'",
                 "decimal literal invalid")


def _compile_error(schema: dict[str, Any]) -> str | None:
    """llguidance's message for ``schema`` on its own, or None when it compiles."""
    from llguidance import LLMatcher
    options: Any = JSON_OPTIONS  # llguidance's JsonCompileOptions
    grammar = LLMatcher.grammar_from_json_schema(schema, overrides=options)
    error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    return (messages[0] if messages else "error") if error else None


def _number_error(node: dict[str, Any], where: str, param: str) -> GrammarError | None:
    """The keyword of the schema ``node`` whose number llguidance cannot write, or None."""
    def number(key: str) -> Any:
        value = node.get(key)
        return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None

    types = node.get("type")
    kinds = types if isinstance(types, list) else [types]
    kind = "integer" if "integer" in kinds and "number" not in kinds else "number"
    bounds = {key: number(key) for key in RANGE_KEYS if number(key) is not None}
    if bounds and (why := _compile_error({"type": kind, **bounds})) is not None:
        alone = [key for key in bounds if _compile_error({"type": kind, key: bounds[key]})]
        key = (alone or list(bounds))[0]
        return GrammarError(param, f"{where}.{key}={shown(bounds[key])}: a range bound "
                                   f"llguidance cannot compile ({why}: it writes a range as a "
                                   "regex of decimal digits in 64-bit integers, and cannot for "
                                   "a bound of 2^63 or more in size or a range from 1e18 up "
                                   "or from -1e18 down with no other bound): give the range "
                                   "both bounds, each within -9.2e18..9.2e18, or leave this "
                                   "one out")
    step = number("multipleOf")
    if step is not None and (why := _compile_error({"type": kind, "multipleOf": step})):
        return GrammarError(param, f"{where}.multipleOf={shown(step)}: a multipleOf llguidance "
                                   f"cannot compile ({why}): write one of fewer significant "
                                   "digits, or leave it out")
    for key in LENGTH_KEYS:
        length = number(key)
        if length is not None and (why := _compile_error({"type": "string", key: length})):
            return GrammarError(param, f"{where}.{key}={shown(length)}: a string length "
                                       "llguidance cannot compile (its regex counts a length "
                                       f"up to 4294967295: {why.splitlines()[-1]}): write a "
                                       "smaller one, or leave it out")
    return None


def _number_place(schema: Any, param: str, message: str) -> GrammarError | None:
    """The keyword of ``schema`` whose number llguidance could not write (its ``message``
    names no place: "Failed to generate regex for float range: min=None, max=Some(1e19)",
    "Value for 'multipleOf' has too many digits: ...", "regex parse error: (?s:.{0,
    4294967296}) ... decimal literal invalid"), as a :class:`GrammarError` naming its place
    and value, or None. llguidance 1.9.1 writes a range as a regex of decimal digits in
    64-bit integers: a bound of 2^63 or more in size (``"maximum": 1e19``), or a one-sided
    range from 1e18 up (from -1e18 down), cannot be written; nor a ``multipleOf`` of many
    significant digits, nor a string length past 2^32-1. Each schema holding such keywords
    is compiled with them alone to find it (breadth first: the outermost first); numbers
    that crashed llguidance never get here (:func:`_finite` refused them)."""
    if not any(text in message for text in NUMBER_FAILED):
        return None
    todo: list[tuple[str, Any]] = [(param, schema)]
    while todo:
        where, node = todo.pop(0)
        if isinstance(node, list):
            todo.extend((f"{where}[{i}]", item) for i, item in enumerate(node))
            continue
        if not isinstance(node, dict):
            continue
        refused = _number_error(node, where, param)
        if refused is not None:
            return refused
        todo.extend((f"{where}.{key}", item) for key, item in node.items()
                    if key not in VALUE_KEYS)
    return None


def _checked(grammar: str, tokenizer: Any, param: str, schema: Any = None) -> str:
    """``grammar`` when llguidance compiles it with ``tokenizer``, else a
    :class:`GrammarError` (naming the keyword of ``schema`` whose number it could not write,
    if that was why)."""
    from llguidance import LLMatcher
    error, messages = LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    if error:
        raise (_number_place(schema, param, messages[0])
               or GrammarError(param, f"{param}: llguidance cannot compile it: {messages[0]}"))
    return grammar


def _need_llguidance(param: str, what: str) -> None:
    why = missing()
    if why is not None:
        raise GrammarError(param, f"{param}: {what} {why}")


def response_format_schema(response_format: Any) -> tuple[Any, bool] | None:
    """``response_format`` -> (the JSON Schema the output follows, strict), or None for text
    (absent, ``{"type": "text"}``). :class:`GrammarError` for anything else."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict) or not isinstance(response_format.get("type"), str):
        raise GrammarError("response_format", "response_format: must be an object with a "
                                              "string \"type\" (text, json_object, json_schema)")
    kind = response_format["type"]
    extra = set(response_format) - {"type", "json_schema"}
    if extra:
        raise GrammarError(f"response_format.{sorted(extra)[0]}",
                           f"response_format.{sorted(extra)[0]}: unknown field")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}, True
    if kind != "json_schema":
        raise GrammarError("response_format", f"response_format.type={shown(kind, 40)}: must be "
                                              "one of text, json_object, json_schema")
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
        raise GrammarError("response_format.json_schema", "response_format.json_schema: must "
                                                          "be an object with name and schema")
    name = spec.get("name")
    if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
        raise GrammarError("response_format.json_schema.name",
                           f"response_format.json_schema.name={shown(name, 80)}: must be a string of "
                           "1 to 64 letters, digits, _ or -")
    unknown = set(spec) - {"name", "schema", "strict", "description"}
    if unknown:
        field = f"response_format.json_schema.{sorted(unknown)[0]}"
        raise GrammarError(field, f"{field}: unknown field")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise GrammarError("response_format.json_schema.strict",
                           f"response_format.json_schema.strict={shown(strict, 40)}: must be a "
                           "boolean")
    schema = spec.get("schema")
    if schema is None:  # absent, or null (an optional field's default): any JSON value
        schema = {}
    return closed_schema(schema), bool(strict)


def completion_structure(response_format: Any, tok: Tokenizer, vocab: int, end_token: int,
                         check: Callable[[], None] = go_on) -> Structure | None:
    """The grammar of a request's ``response_format`` (None: free text). ``check`` is called
    between the compile's steps (:class:`Abandoned`: the request is gone, stop there)."""
    check()
    asked = response_format_schema(response_format)
    if asked is None:
        return None
    _need_llguidance("response_format", f"{response_format.get('type')}")
    schema, strict = asked
    param = ("response_format.json_schema.schema" if response_format["type"] == "json_schema"
             else "response_format")
    ll = ll_tokenizer(tok, vocab, end_token, "response_format",
                      f"{response_format.get('type')}")
    check()
    grammar = _schema_grammar(schema, param, strict)
    matcher = _matcher(grammar, ll, param, schema, check)
    finite = _finite_mirror(["start: fvalue"])
    return Structure(grammar, ll, vocab, end_token, finite=finite, matcher=matcher,
                     mirror=_mirror(finite, ll, check))


def _finite_mirror(lines: list[str]) -> str:
    """The serialized Lark grammar of ``lines`` (whose JSON values are ``fvalue``) with
    :data:`FINITE_JSON`."""
    from llguidance import LLMatcher
    return LLMatcher.grammar_from_lark("\n".join([*lines, FINITE_JSON]))


def tool_setup(tools: Any, tool_choice: Any, functions: Any = None) -> ToolSetup:
    """Check ``tools`` and ``tool_choice`` (OpenAI's shapes) -> :class:`ToolSetup`;
    :class:`GrammarError` naming the bad field."""
    if tools is None or tools == []:
        if tool_choice not in (None, "none"):
            raise GrammarError("tool_choice", f"tool_choice={shown(tool_choice, 80)}: needs tools")
        return ToolSetup()
    if not isinstance(tools, list):
        raise GrammarError("tools", "tools: must be a list of {\"type\": \"function\", "
                                    "\"function\": {...}}")
    parsed: list[Tool] = []
    for i, entry in enumerate(tools):
        where = f"tools.{i}"
        fn = _function_entry(entry, where, "unknown field")
        if not isinstance(fn, dict):
            raise GrammarError(f"{where}.function", f"{where}.function: must be an object")
        unknown = set(fn) - {"name", "description", "parameters", "strict"}
        if unknown:
            field = f"{where}.function.{sorted(unknown)[0]}"
            raise GrammarError(field, f"{field}: unknown field")
        name = fn.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
            raise GrammarError(f"{where}.function.name",
                               f"{where}.function.name={shown(name, 80)}: must be a string of 1 to "
                               "64 letters, digits, _ or -")
        if any(t.name == name for t in parsed):
            raise GrammarError(f"{where}.function.name",
                               f"{where}.function.name={shown(name)}: declared twice")
        params = fn.get("parameters")
        if params is None:  # OpenAI: "omitting parameters defines ... an empty parameter list"
            params = {"type": "object", "properties": {}, "additionalProperties": False}
        if not isinstance(params, dict):
            raise GrammarError(f"{where}.function.parameters",
                               f"{where}.function.parameters={shown(params, 80)}: must be a "
                               "JSON Schema, a JSON object (such as {\"type\": \"object\"}), "
                               "or left out")
        if "type" not in params:  # the arguments are an object whatever the schema leaves open
            params = {**params, "type": "object"}
        description = fn.get("description")
        if description is not None and not isinstance(description, str):
            raise GrammarError(f"{where}.function.description",
                               f"{where}.function.description: must be a string")
        strict = fn.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise GrammarError(f"{where}.function.strict",
                               f"{where}.function.strict={shown(strict, 40)}: must be a boolean")
        parsed.append(Tool(name, closed_schema(params), description, bool(strict)))
    allowed = _allowed_tools(tool_choice, parsed)
    if allowed is not None:  # the template lists every tool, the output calls these alone
        mode, callable_tools = allowed
        return ToolSetup(callable_tools, mode, tuple(tools))
    choice, named = _tool_choice(tool_choice, parsed)
    if choice == "none" and not named:
        return ToolSetup((), "none", tuple(tools))
    return ToolSetup(tuple(parsed), choice, tuple(tools), named)


def _function_entry(entry: Any, where: str, unknown: str) -> Any:
    """``entry["function"]`` of a ``{"type": "function", "function": ...}`` entry at ``where``
    (a tool of ``tools``, a tool ``allowed_tools`` lists); :class:`GrammarError` naming
    ``where.type`` for another type, ``where.KEY`` (``unknown`` says what it is) for another
    key."""
    if not isinstance(entry, dict) or entry.get("type") != "function":
        kind = entry.get("type") if isinstance(entry, dict) else entry
        raise GrammarError(f"{where}.type", f"{where}.type={shown(kind, 40)}: only \"function\" "
                                            "tools are supported")
    extra = sorted(set(entry) - {"type", "function"})
    if extra:
        field = f"{where}.{extra[0][:80]}"
        raise GrammarError(field, f"{field}: {unknown}")
    return entry.get("function")


#: ``tool_choice`` ``{"type": "allowed_tools", ...}``'s modes (OpenAI's)
ALLOWED_TOOLS_MODES = ("auto", "required")


def _allowed_tools(tool_choice: Any, tools: list[Tool]) -> tuple[str, tuple[Tool, ...]] | None:
    """OpenAI's ``tool_choice: {"type": "allowed_tools", "allowed_tools": {"mode": "auto" |
    "required", "tools": [{"type": "function", "function": {"name": ...}}, ...]}}`` ->
    (the mode, the tools of ``tools`` it lists, in ``tools``' order); None for any other
    ``tool_choice``. The output may call only the listed tools (``auto``: or answer in text;
    ``required``: one call or more), while the chat template still lists every tool (what
    ``allowed_tools`` is for: the prompt, and its cache, stay the same as the allowed set
    changes). :class:`GrammarError` naming the field: a tool listed that is not among
    ``tools``, listed twice, a mode other than ``auto``/``required``, an unknown key."""
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "allowed_tools":
        return None
    where = "tool_choice"
    extra = sorted(set(tool_choice) - {"type", "allowed_tools"})
    if extra:
        raise GrammarError(f"{where}.{extra[0][:80]}", f"{where}.{extra[0][:80]}: unknown key "
                           "(allowed_tools takes {\"type\": \"allowed_tools\", "
                           "\"allowed_tools\": {\"mode\": ..., \"tools\": [...]}})")
    spec = tool_choice.get("allowed_tools")
    where += ".allowed_tools"
    if not isinstance(spec, dict):
        raise GrammarError(where, f"{where}={shown(spec, 80)}: must be an object {{\"mode\": "
                                  "\"auto\" | \"required\", \"tools\": [{\"type\": "
                                  "\"function\", \"function\": {\"name\": ...}}, ...]}")
    extra = sorted(set(spec) - {"mode", "tools"})
    if extra:
        raise GrammarError(f"{where}.{extra[0][:80]}", f"{where}.{extra[0][:80]}: unknown key")
    mode = spec.get("mode")
    if mode not in ALLOWED_TOOLS_MODES:
        raise GrammarError(f"{where}.mode", f"{where}.mode={shown(mode, 80)}: must be \"auto\" "
                                            "or \"required\"")
    listed = spec.get("tools")
    if not isinstance(listed, list) or not listed:
        raise GrammarError(f"{where}.tools", f"{where}.tools={shown(listed, 80)}: must list one "
                                             "tool or more, [{\"type\": \"function\", "
                                             "\"function\": {\"name\": ...}}, ...]")
    declared = [t.name for t in tools]
    names: list[str] = []
    for i, entry in enumerate(listed):
        at = f"{where}.tools.{i}"
        fn = _function_entry(entry, at, "unknown key")
        if not isinstance(fn, dict) or set(fn) - {"name"}:
            raise GrammarError(f"{at}.function", f"{at}.function={shown(fn, 80)}: must be "
                                                 "{\"name\": ...}, a tool's name")
        name = fn.get("name")
        if name not in declared:
            raise GrammarError(f"{at}.function.name",
                               f"{at}.function.name={shown(name, 80)}: not one of the tools "
                               f"{shown(declared, 300)}")
        if name in names:
            raise GrammarError(f"{at}.function.name",
                               f"{at}.function.name={shown(name, 80)}: listed twice")
        names.append(name)
    return mode, tuple(t for t in tools if t.name in names)


def _tool_choice(tool_choice: Any, tools: list[Tool]) -> tuple[str, bool]:
    """(the mode or the named function's name, whether it is a name)."""
    if tool_choice is None:
        return "auto", False  # OpenAI's default when tools are given
    if tool_choice in ("none", "auto", "required"):
        return str(tool_choice), False
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function" \
            and isinstance(tool_choice.get("function"), dict) \
            and set(tool_choice) == {"type", "function"}:
        name = tool_choice["function"].get("name")
        if not any(t.name == name for t in tools):
            raise GrammarError("tool_choice", f"tool_choice.function.name={shown(name, 80)}: not "
                                              f"one of the tools {[t.name for t in tools]}")
        return str(name), True
    raise GrammarError("tool_choice", f"tool_choice={shown(tool_choice, 80)}: must be \"none\", "
                                      "\"auto\", \"required\", {\"type\": \"function\", "
                                      "\"function\": {\"name\": ...}} or {\"type\": "
                                      "\"allowed_tools\", \"allowed_tools\": {\"mode\": ..., "
                                      "\"tools\": [...]}}")


#: where a call object holds its parameters' schema (a JSON pointer from the call's root)
ARGUMENTS_POINTER = "#/properties/arguments"


def _rebased(schema: Any, moved: tuple[str, ...]) -> Any:
    """``schema`` (a tool's parameters) with each local ``$ref`` pointing where it points once
    the parameters sit at :data:`ARGUMENTS_POINTER` of a call object: ``#`` (the parameters
    themselves: a tree of nodes) and ``#/properties/a`` (zod-to-json-schema's default
    ``$refStrategy: "root"`` writes a schema used twice so) get that prefix; a pointer into
    a definitions keyword in ``moved`` (up to the call's root) is left as it is. Values
    (``const``, ``enum``, ``default``, ``examples``) are data, not walked. A copy; the walk
    is bounded by the body's own nesting limit."""
    if isinstance(schema, list):
        return [_rebased(item, moved) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")) \
                and not any(value == f"#/{name}" or value.startswith(f"#/{name}/")
                            for name in moved):
            out[key] = ARGUMENTS_POINTER + value[1:]
        elif key in _SCHEMA_MAPS and isinstance(value, dict):  # names -> schemas
            out[key] = {name: _rebased(sub, moved) for name, sub in value.items()}
        elif key in VALUE_KEYS:
            out[key] = value
        else:
            out[key] = _rebased(value, moved)
    return out


def _call_schema(tool: Tool) -> dict[str, Any]:
    """The JSON Schema of one call's object, as Qwen3 writes it: name first, then arguments.
    The parameters' definitions (``$defs``, draft-07's ``definitions``: pydantic's nested
    models) move up to the call object's root, which their references (``#/$defs/X``, from
    the parameters' root) now name; every other local reference is rebased onto the
    arguments (:func:`_rebased`: until stop 63 ``#/properties/a`` was a 400 ``Pointer
    '/properties/a' does not exist`` with ``tool_choice`` "auto" or "required", and ``#``
    named the call object, so a tree's child was a call)."""
    arguments = dict(tool.parameters)
    definitions: dict[str, Any] = {key: arguments.pop(key) for key in ("$defs", "definitions")
                                   if key in arguments}
    arguments = _rebased(arguments, tuple(definitions))
    definitions = {key: _rebased(value, tuple(definitions))
                   for key, value in definitions.items()}
    return {"type": "object",
            "properties": {"name": {"const": tool.name}, "arguments": arguments},
            "required": ["name", "arguments"], "additionalProperties": False, **definitions,
            "x-guidance": {**JSON_OPTIONS, "lenient": not tool.strict}}


def chat_structure(response_format: Any, setup: ToolSetup, parallel_tool_calls: bool | None,
                   tok: Tokenizer, vocab: int, end_token: int,
                   check: Callable[[], None] = go_on) -> Structure | None:
    """The grammar of a chat request: its tools (``setup``) and ``response_format``. With
    ``tool_choice`` "required" the output is one or more calls (one when
    ``parallel_tool_calls`` is false), with a named function one call of that function (as
    vLLM, whatever ``parallel_tool_calls`` says); with "auto" free
    text without a call, or text then calls (every call follows its schema: a call can only
    be written as one), or with ``response_format`` its JSON answer or calls; no tools: the
    ``response_format`` alone (None: free text). ``check``: as :func:`completion_structure`'s."""
    if not setup.tools:
        return completion_structure(response_format, tok, vocab, end_token, check)
    _need_llguidance("tools", f"tool_choice={shown(setup.choice)}")
    asked = response_format_schema(response_format)
    ll = ll_tokenizer(tok, vocab, end_token, "tools", f"tool_choice={shown(setup.choice)}")
    arguments: dict[str, tuple[str, Any]] = {}
    for i, tool in enumerate(setup.tools):  # each tool's schema on its own: the field named
        param = f"tools.{i}.function.parameters"
        parameters = dict(tool.parameters)
        check()
        grammar = _schema_grammar(parameters, param, tool.strict)
        arguments[tool.name] = (grammar, _matcher(grammar, ll, param, parameters, check))
    tools = [t for t in setup.tools if not setup.named or t.name == setup.choice]
    if setup.named:
        # as vLLM: the output is the named function's arguments alone (one JSON value), the
        # call around them the response's (ToolCallStream's ``named``); the <tool_call>
        # markup and the name, generated, took max_tokens a tight budget needed for the
        # arguments: a call vLLM completes ("stop") ended "length", its markup the content
        finite = _finite_mirror(["start: fvalue"])
        grammar, matcher = arguments[setup.choice]
        return Structure(grammar, ll, vocab, end_token, tuple(tools), setup.choice, True,
                         finite, matcher, _mirror(finite, ll, check))
    lines = ['call: "' + CALL_OPEN + '\\n" fn "\\n' + CALL_CLOSE + '"',
             "fn: " + " | ".join(f"fn{i}" for i in range(len(tools)))]
    mirror = lines + [f"fn{i}: fvalue" for i in range(len(tools))]
    lines += [f"fn{i}: %json {json.dumps(_call_schema(t))}" for i, t in enumerate(tools)]
    # a named function is called once, as vLLM answers it (the function's arguments, one
    # call) and as OpenAI's forced function: "calls of that one" went on call after call
    # until max_tokens, and an answer cut in the next call's arguments had no call at all
    more = "" if parallel_tool_calls is False or setup.named else ' ("\\n" call)*'
    lines.append("calls: call" + more)
    mirror.append("calls: call" + more)
    if setup.choice == "auto" and not setup.named:
        if asked is None:  # text without a call, or text (maybe none) then calls
            open_tag = re.escape(CALL_OPEN)
            lines.append(f"TEXT: /(?s:.*)/ & ~/(?s:.*){open_tag}(?s:.*)/")
            lines.append(f"lead[lazy]: /(?s:.*){open_tag}\\n/")
            lines.append('start: TEXT | lead fn "\\n' + CALL_CLOSE + '"' + more)
            mirror += lines[-3:]
        else:
            schema, strict = asked
            if not isinstance(schema, dict):
                raise GrammarError("response_format.json_schema.schema",
                                   f"response_format.json_schema.schema={shown(schema, 80)}: "
                                   "must be a JSON Schema, a JSON object (such as "
                                   "{\"type\": \"object\"})")
            param = ("response_format.json_schema.schema"
                     if response_format["type"] == "json_schema" else "response_format")
            # checked on its own, as without tools (it is written into the grammar below)
            check()
            _matcher(_schema_grammar(schema, param, strict), ll, param, schema, check)
            lines.append("answer: %json " + json.dumps(
                {**schema, "x-guidance": {**JSON_OPTIONS, "lenient": not strict}}))
            lines.append("start: answer | calls")
            mirror += ["answer: fvalue", "start: answer | calls"]
    else:
        lines.append("start: calls")
        mirror.append("start: calls")
    from llguidance import LLMatcher
    check()
    grammar = LLMatcher.grammar_from_lark("\n".join(lines))
    matcher = _matcher(grammar, ll, "tools", check=check, admits=False)
    finite = _finite_mirror(mirror)
    return Structure(grammar, ll, vocab, end_token, tuple(tools), setup.choice, setup.named,
                     finite, matcher, _mirror(finite, ll, check))


# ---- tool calls in the output ---------------------------------------------------------------
def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _tool_call(name: str, arguments: str, index: int | None = None) -> dict[str, Any]:
    call: dict[str, Any] = {"id": call_id(), "type": "function",
                            "function": {"name": name, "arguments": arguments}}
    return call if index is None else {"index": index, **call}


def parse_tool_calls(text: str, named: str | None = None, forced: bool = False
                     ) -> tuple[str | None, list[dict[str, Any]]]:
    """A finished output -> (content, OpenAI ``tool_calls``), exactly what
    :class:`ToolCallStream` streams for it: each ``<tool_call>\\n{"name": ..., "arguments":
    {...}}\\n</tool_call>`` is a call (``function.arguments`` the arguments' JSON text as
    generated), the text outside the calls is the content (None when there is none). An
    output cut short (max_tokens) in a call's closing markup or in the opening of one more
    call has the calls, as streamed; cut in the opening of its first call (before the call
    is named), the text before that opening is the content, as streamed (the opening is the
    call's markup, no content); cut inside a call's arguments (not one JSON value): no calls,
    the whole text is the content, as vLLM parses a model's cut call (the stream sent the
    arguments as generated), except for a ``forced`` call (``tool_choice`` "required" or a
    named function: the grammar wrote the call, the model only its arguments), which is the
    call with its arguments as generated, as streamed (vLLM's named call, OpenAI's).
    ``named`` (``tool_choice`` named the function): the text is its arguments, one call of
    it, also when cut short (as vLLM answers a named call: ``finish_reason`` says "length")."""
    stream = ToolCallStream(named, forced)
    deltas = stream.feed(text, final=True)
    if (stream.args_cut and not forced and named is None) \
            or not (stream.calls or stream.cut):
        return text, []
    content = "".join(d.get("content", "") for d in deltas)
    calls: list[dict[str, Any]] = []
    for delta in deltas:
        for piece in delta.get("tool_calls", ()):
            if "id" in piece:
                calls.append({k: v for k, v in piece.items() if k != "index"})
                calls[-1]["function"] = dict(piece["function"])
            else:
                calls[piece["index"]]["function"]["arguments"] += piece["function"]["arguments"]
    return content or None, calls


class ToolCallStream:
    """Streamed text -> chat ``delta`` pieces: plain text as ``content``; a tool call as
    OpenAI streams it, a first ``tool_calls`` delta with its ``index``, ``id``, ``type`` and
    ``function.name`` (``arguments`` empty), then ``function.arguments`` pieces as they are
    generated. Text that may still open a call (a prefix of ``<tool_call>``) or end one is
    held back until it is known. ``calls``: calls opened.
    ``named``: ``tool_choice`` named this function, whose arguments alone the output is (no
    markup, chat_structure): its one call opens with the first text, every piece is its
    arguments. ``forced`` (``tool_choice`` "required"): the output is calls only, so an end
    cut inside the ``<tool_call>`` tag itself (``<to``) is markup, as it is after a call
    under any ``tool_choice`` (the grammar lets only calls follow a call)."""

    _OPENED = re.compile(re.escape(CALL_OPEN) + r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")'
                         r'\s*,\s*"arguments"\s*:\s*')
    #: the end of a call's arguments as the grammar writes it: the call object's "}", a line
    #: end (never raw inside compact JSON), the close tag
    _END = "}\n" + CALL_CLOSE

    def __init__(self, named: str | None = None, forced: bool = False) -> None:
        self._named = named
        self._forced = forced
        self._text = ""
        self._at = 0  # characters of _text turned into deltas
        self._in_call = False
        self._args = 0  # where the open call's arguments start in _text
        self.calls = 0
        #: the output ended inside a call, or with one opened but not named (max_tokens)
        self.cut = False
        #: the output ended inside a call's arguments (not one JSON value yet): the stream
        #: sent them as generated; a whole answer has no calls then, its text is the content
        self.args_cut = False

    def feed(self, piece: str, final: bool = False) -> list[dict[str, Any]]:
        """The deltas ``piece`` completes (``final``: the end of the output: flush)."""
        self._text += piece
        if self._named is not None:
            return self._arguments(piece, final)
        deltas: list[dict[str, Any]] = []
        while True:
            rest = self._text[self._at:]
            if self._in_call:
                end = rest.find(self._END)
                upto = end if end >= 0 else _args_ready(rest, self._END)
                if end < 0 and final and upto < len(rest) and \
                        not whole_json(self._text[self._args:self._at + upto]):
                    upto = len(rest)  # cut inside the arguments: as generated
                if end < 0 and final and not whole_json(self._text[self._args:self._at + upto]):
                    self.args_cut = True
                if upto:
                    deltas.append({"tool_calls": [{"index": self.calls - 1, "function": {
                        "arguments": rest[:upto]}}]})
                if end < 0:
                    self._at += upto
                    self.cut = self.cut or final
                    return deltas
                self._at += end + len(self._END)
                self._in_call = False
                continue
            start = rest.find(CALL_OPEN)
            while start >= 0 and not _may_open(rest[start:]):  # a tag in the text, no call
                start = rest.find(CALL_OPEN, start + 1)
            opened = self._OPENED.match(rest, start) if start >= 0 else None
            if opened is not None:
                self._content(rest[:start], deltas)
                deltas.append({"tool_calls": [_tool_call(json.loads(opened.group(1)), "",
                                                         self.calls)]})
                self.calls += 1
                self._in_call = True
                self._at += opened.end()
                self._args = self._at
                continue
            if final:  # an opening cut short is the call's markup, no content
                if start < 0 and (self.calls or self._forced) and _open_prefix(rest):
                    start = len(rest) - _open_prefix(rest)  # cut in the tag: only calls here
                self.cut = self.cut or start >= 0
                self._content(rest if start < 0 else rest[:start], deltas, final=True)
                self._at += len(rest)
            else:
                ready = start if start >= 0 else len(rest) - _open_prefix(rest)
                if self.calls and not rest[:ready].strip():
                    ready = 0  # the line end between two calls: wait for what follows
                self._content(rest[:ready], deltas)
                self._at += ready
            return deltas

    def _arguments(self, piece: str, final: bool) -> list[dict[str, Any]]:
        """A named function's call: opened by the first text (or the end), then arguments."""
        deltas: list[dict[str, Any]] = []
        if not self.calls and (piece or final):
            deltas.append({"tool_calls": [_tool_call(str(self._named), piece, 0)]})
            self.calls = 1
        elif piece:
            deltas.append({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]})
        if final:
            self.cut = self.args_cut = not whole_json(self._text)
        return deltas

    def _content(self, text: str, deltas: list[dict[str, Any]], final: bool = False) -> None:
        if self.calls and not text.strip():
            return  # whitespace between or after calls
        if text:
            deltas.append({"content": text})


#: how the grammar opens a call
_CALL_HEAD = CALL_OPEN + '\n{"name":'


def _may_open(tail: str) -> bool:
    """``tail`` (from a ``<tool_call>`` on) is a call's opening, or may still become one."""
    return _CALL_HEAD.startswith(tail) or tail.startswith(_CALL_HEAD)


def _open_prefix(text: str) -> int:
    """Length of the longest end of ``text`` that starts ``<tool_call>``."""
    for n in range(min(len(CALL_OPEN) - 1, len(text)), 0, -1):
        if CALL_OPEN.startswith(text[-n:]):
            return n
    return 0


def whole_json(text: str) -> bool:
    """``text`` is one JSON value (a cut call's arguments, whole before the held end)."""
    try:
        json.loads(text)
    except (ValueError, RecursionError):
        return False
    return True


def _args_ready(rest: str, end: str) -> int:
    """How much of a call's streamed arguments can go out: all but an end that may be the
    start of ``end`` (the call's "}", line end, close tag)."""
    at = rest.rfind("}")
    if at >= 0 and end.startswith(rest[at:]):
        return at
    return len(rest)


# ---- tool calls and tool results in the chat history -----------------------------------------
def check_history_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` (OpenAI's shape) checked: the calls, or
    :class:`GrammarError` naming ``where``'s bad field."""
    if not isinstance(calls, list):
        raise GrammarError(where, f"{where}: must be a list of tool calls")
    for j, call in enumerate(calls):
        at = f"{where}.{j}"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(call, dict) or call.get("type", "function") != "function" \
                or not isinstance(fn, dict):
            raise GrammarError(at, f"{at}: must be {{\"id\", \"type\": \"function\", "
                                   "\"function\": {\"name\", \"arguments\"}}")
        if not isinstance(fn.get("name"), str):
            raise GrammarError(f"{at}.function.name", f"{at}.function.name: must be a string")
        if not isinstance(fn.get("arguments"), str):
            raise GrammarError(f"{at}.function.arguments",
                               f"{at}.function.arguments: must be a string (JSON)")
    return calls


def call_text(calls: Sequence[Mapping[str, Any]]) -> str:
    """Tool calls as Qwen3 writes them (what the plain template renders)."""
    blocks = []
    for call in calls:
        fn = call["function"]
        try:
            arguments: Any = json.loads(fn["arguments"])
        except (ValueError, RecursionError):  # (valid JSON nested past the recursion limit)
            arguments = fn["arguments"]  # as given: the model's own text
        blocks.append(f"{CALL_OPEN}\n" + json.dumps({"name": fn["name"], "arguments": arguments},
                                                    ensure_ascii=False) + f"\n{CALL_CLOSE}")
    return "\n".join(blocks)


def tools_preamble(declared: Sequence[Mapping[str, Any]]) -> str:
    """The plain template's line listing the tools (Qwen3 lists them in its system turn)."""
    return "tools: " + json.dumps([t.get("function", t) for t in declared],
                                  ensure_ascii=False) + "\n"
