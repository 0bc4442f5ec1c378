"""Stop 63's probe with real clients (the official ``openai`` SDK) against a loopback server on
the synthetic model: ``anyOf``/``oneOf`` branches beside other keys, ``unevaluatedProperties``
beside an applicator, and integer bounds llguidance caps at 2^63-1 (docs/traceability.md
"Found at stop 63 (clients)"). Client timeout 10 s, no retries; each sampled answer is asked
with a seed, so it is the same on every run."""

from __future__ import annotations

import json

import openai
import pytest

import needs
from calexec.drivers.serving.grammar import closed_schema
from test_server_support import MODEL, openai_server

TIMEOUT_S = 10.0
SEEDS = range(12)
#: branch A: a short string; branch B: a boolean; beside them a required boolean ``c``
A = {"properties": {"a": {"type": "string", "maxLength": 2}}, "required": ["a"]}
B = {"properties": {"b": {"type": "boolean"}}, "required": ["b"]}
C = {"properties": {"c": {"type": "boolean"}}, "required": ["c"]}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with openai_server(tmp_path_factory.mktemp("calbin"), timeout=TIMEOUT_S) as (server, sdk,
                                                                                 _):
        yield server, sdk


def _answer(sdk: openai.OpenAI, schema: dict, how: str, seed: int, max_tokens: int = 80
            ) -> tuple[dict, str]:
    """(the JSON answered, finish_reason) of ``schema`` as a ``response_format`` or as the
    parameters of a named tool's call, sampled with ``seed``."""
    asked = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
             "max_tokens": max_tokens, "seed": seed, "temperature": 1.0}
    if how == "response_format":
        answer = sdk.chat.completions.create(
            **asked, response_format={"type": "json_schema",
                                      "json_schema": {"name": "p", "schema": schema}})
        text = answer.choices[0].message.content
    else:
        answer = sdk.chat.completions.create(
            **asked, tools=[{"type": "function", "function": {"name": "p",
                                                              "parameters": schema}}],
            tool_choice={"type": "function", "function": {"name": "p"}})
        calls = answer.choices[0].message.tool_calls
        assert calls and len(calls) == 1, answer
        text = calls[0].function.arguments
    assert text is not None, answer
    return json.loads(text), answer.choices[0].finish_reason


def _a_or_b_with_c(value: dict) -> bool:
    """Whether ``value`` is branch A's object or branch B's, each with ``c``, nothing more."""
    if not isinstance(value.get("c"), bool):
        return False
    if set(value) == {"a", "c"}:
        return isinstance(value["a"], str) and len(value["a"]) <= 2
    return set(value) == {"b", "c"} and isinstance(value["b"], bool)


INLINE = {"type": "object", "allOf": [{"anyOf": [A, B]}, C]}
REFERENCED = {"type": "object", "$defs": {"A": A, "B": B, "AorB": {"oneOf": [
    {"$ref": "#/$defs/A"}, {"$ref": "#/$defs/B"}]}},
    "allOf": [{"$ref": "#/$defs/AorB"}, C]}


@pytest.mark.parametrize("schema", [INLINE, REFERENCED], ids=["inline", "referenced"])
@pytest.mark.parametrize("how", ["response_format", "named_tool"])
def test_an_anyof_inside_an_allof_member_keeps_each_branchs_keys_and_shapes(served, schema,
                                                                           how):
    """``allOf: [{anyOf: [A, B]}, C]`` (and a ``$ref``'d ``oneOf`` as the member): on the old
    code the parent was closed on the union of the keys, every member left open, so a key of
    branch A could follow branch B with any shape: seed 2 answered ``{"b":true,"c":false,
    "a":true}`` (``a`` is A's string), seed 3 ``{"a":"lʐ","c":true,"b":554E0486...}``
    (``b`` is B's boolean). Each branch now allows its own keys and those beside it, so an
    answer is A's object or B's, each with ``c``."""
    needs.module("llguidance", "server")
    _, sdk = served
    for seed in SEEDS:
        value, finish = _answer(sdk, schema, how, seed)
        assert finish == "stop", (seed, value)
        assert _a_or_b_with_c(value), (seed, value)


@pytest.mark.parametrize("schema", [
    pytest.param({"type": "object", **C, "oneOf": [A, B]}, id="oneOf"),
    pytest.param({"type": "object", **C, "anyOf": [A, B]}, id="anyOf"),
    pytest.param({"type": "object", **C, "anyOf": [A, B], "unevaluatedProperties": False},
                 id="anyOf_unevaluatedProperties_false"),
])
@pytest.mark.parametrize("how", ["response_format", "named_tool"])
def test_common_keys_beside_anyof_variants_are_served_with_one_variant(served, schema, how):
    """Keys every variant has beside the variants (``{"properties": {"c"}, "required":
    ["c"], "oneOf": [A, B]}``, a hand-written tagged union): the old code closed the parent
    on ``c`` and each branch on its own key, so no object could hold ``c`` and a branch's
    key: a 400 ``llguidance cannot compile it: Unsatisfiable schema: required property 'c'
    is unsatisfiable`` (with ``"unevaluatedProperties": false`` beside the ``anyOf``, which
    was ignored, too). Now the parent takes the union and each branch its keys and ``c``."""
    needs.module("llguidance", "server")
    _, sdk = served
    for seed in SEEDS[:4]:
        value, finish = _answer(sdk, schema, how, seed)
        assert finish == "stop", (seed, value)
        assert _a_or_b_with_c(value), (seed, value)


def test_unevaluated_properties_false_beside_an_if_is_refused_naming_the_if(served):
    """``"unevaluatedProperties": false`` beside ``if``/``then``/``else`` was ignored (as
    llguidance ignores it, and the conditional too): the named tool's arguments went on with
    the model's own keys (seed 2: ``{"c":true,";ع":0}``). Stop 63 closed the object on the
    keys its properties and its conditional declare, but the condition was still not applied
    (``{"c":false,"a":"x"}`` was let through: ``a`` is unevaluated where ``else`` holds);
    since stop 64 a conditional is a 400 naming the ``if`` and its place."""
    needs.module("llguidance", "server")
    _, sdk = served
    schema = {"type": "object", **C, "if": {"properties": {"c": {"const": True}}},
              "then": {"properties": {"a": {"type": "string", "maxLength": 2}}},
              "else": {"properties": {"b": {"type": "boolean"}}},
              "unevaluatedProperties": False}
    with pytest.raises(openai.BadRequestError) as caught:
        _answer(sdk, schema, "named_tool", 0)
    assert '"if" at /if' in str(caught.value), caught.value


def test_closed_schema_closes_each_branch_on_its_keys_and_those_beside_it():
    """The rewrite itself: the parent's own ``anyOf`` branches are closed in place on their
    keys and the parent's; a group in an ``allOf`` member is repeated as one more member, its
    branches so closed; a branch that says it is open stays open."""
    open_b = {**B, "additionalProperties": True}
    out = closed_schema({**C, "anyOf": [A, open_b]})
    assert "additionalProperties" not in out, out  # a branch says other keys are allowed
    assert out["anyOf"] == [A, open_b], out  # its branches left open, as given
    out = closed_schema({**C, "anyOf": [A, B]})
    assert out["additionalProperties"] is False, out
    assert out["anyOf"] == [{**A, "properties": {**A["properties"], "c": {}},
                              "additionalProperties": False},
                             {**B, "properties": {**B["properties"], "c": {}},
                              "additionalProperties": False}], out
    out = closed_schema({"allOf": [{"anyOf": [A, B]}, C]})  # an inline member's, in place
    assert out["allOf"][1] == C and len(out["allOf"]) == 2, out
    assert [(branch["properties"], branch["additionalProperties"])
            for branch in out["allOf"][0]["anyOf"]] == [
        ({**A["properties"], "c": {}}, False), ({**B["properties"], "c": {}}, False)], out
    out = closed_schema(REFERENCED)  # a definition's (shared): repeated as one more member
    assert [sorted(branch["properties"]) for branch in out["allOf"][2]["anyOf"]] == [
        ["a", "c"], ["b", "c"]], out


def test_branches_closing_into_a_schema_too_large_take_the_union(served):
    """Closed branches are larger, and llguidance intersects an ``allOf``'s ``anyOf``
    members branch by branch: two groups of 40 and 5 branches, served until now, were "schema
    too large" once each branch was closed. Such a schema keeps the parent's union (as
    served until stop 63) rather than becoming a 400."""
    needs.module("llguidance", "server")
    _, sdk = served
    branches = [{"properties": {f"k{i}": {"type": "boolean"}, "kind": {"const": f"v{i}"}},
                 "required": ["kind", f"k{i}"]} for i in range(40)]
    schema = {"type": "object", "allOf": [{"anyOf": branches}, {"anyOf": branches[:5]}, C]}
    value, finish = _answer(sdk, schema, "response_format", 0, max_tokens=400)
    assert finish == "stop" and isinstance(value["c"], bool), value


@pytest.mark.parametrize("schema,where", [
    pytest.param({"type": "integer", "const": 2 ** 63}, "const=9223372036854775808",
                 id="const_2_to_the_63"),
    pytest.param({"type": "integer", "const": 1e19}, "const=1e+19", id="const_1e19"),
    pytest.param({"type": "integer", "enum": [1, 10 ** 19]}, "enum[1]=10000000000000000000",
                 id="enum"),
    pytest.param({"type": "integer", "minimum": 1e19, "maximum": 1.1e19}, "minimum=1e+19",
                 id="range_above_2_to_the_63"),
    pytest.param({"type": "integer", "exclusiveMinimum": 2 ** 63},
                 "exclusiveMinimum=9223372036854775808",
                 id="exclusive_minimum"),
    pytest.param({"type": "integer", "minimum": 0, "maximum": 2 ** 64 - 1},
                 "maximum=18446744073709551615", id="uint64_maximum"),
    pytest.param({"allOf": [{"type": "integer"}, {"const": 2 ** 63}]},
                 "allOf[1].const=9223372036854775808", id="type_from_an_allof_member"),
])
@pytest.mark.parametrize("how", ["response_format", "named_tool"])
def test_an_integer_bound_llguidance_caps_at_2_to_the_63_is_a_400_naming_it(served, schema,
                                                                           where, how):
    """llguidance 1.9.1 holds an integer's range, ``const`` and ``enum`` in 64-bit signed
    integers, capping a bound at 2^63-1 without a word: on the old code ``{"type":
    "integer", "const": 9223372036854775808}`` (``1e19``, an ``enum`` member, a range from
    1e19) was answered ``9223372036854775807``, ``"stop"``, a value the schema does not
    allow, and ``"maximum": 18446744073709551615`` was refused as an integer "a double"
    cannot hold, its advice (write one a double holds: ``1.8446744073709552e19``) served
    half the range. Now each is a 400 naming the bound and what to write."""
    needs.module("llguidance", "server")
    _, sdk = served
    wrapped = {"type": "object", "properties": {"x": schema}, "required": ["x"]}
    with pytest.raises(openai.BadRequestError) as caught:
        _answer(sdk, wrapped, how, 0)
    error = caught.value.body
    param = ("response_format.json_schema.schema" if how == "response_format"
             else "tools.0.function.parameters")
    assert error["param"] == param, error
    assert f"{param}.properties.x.{where}: an integer bound llguidance caps at 2^63-1" \
        in error["message"], error
    assert "9223372036854774784" in error["message"], error


@pytest.mark.parametrize("schema,value", [
    pytest.param({"type": "integer", "minimum": 0, "exclusiveMaximum": 2 ** 63}, None,
                 id="exclusive_maximum_2_to_the_63"),
    pytest.param({"type": "integer", "const": 9223372036854774784}, 9223372036854774784,
                 id="the_largest_a_message_offers"),
    pytest.param({"const": 10 ** 19}, 10 ** 19, id="a_const_of_no_integer_type"),
])
def test_an_integer_bound_llguidance_keeps_is_served_as_written(served, schema, value):
    """What the refusal says to write is served, and so are the numbers llguidance keeps
    (a bound that caps nothing, a ``const`` where no integer is declared)."""
    needs.module("llguidance", "server")
    _, sdk = served
    wrapped = {"type": "object", "properties": {"x": schema}, "required": ["x"]}
    answered, finish = _answer(sdk, wrapped, "response_format", 0)
    assert finish == "stop", answered
    if value is None:
        assert isinstance(answered["x"], int) and 0 <= answered["x"] < 2 ** 63, answered
    else:
        assert answered["x"] == value, answered


def test_an_integer_past_64_bits_is_refused_saying_so_not_naming_doubles(served):
    """``"minimum": -2**70`` and ``2**70`` (doubles hold both exactly) were refused saying
    "an integer llguidance cannot take as written (it reads a schema's numbers as doubles
    ...): write one a double holds", which each is; the 400 now says what is true (below
    -2^63+2048; 2^64 or more) and what to write."""
    needs.module("llguidance", "server")
    _, sdk = served
    for where, schema, said in [
            ("minimum=-1180591620717411303424", {"type": "integer", "minimum": -2 ** 70},
             "below -2^63+2048"),
            ("minItems=1180591620717411303424", {"type": "array", "minItems": 2 ** 70},
             "2^64 or more"),
            ("minimum=1180591620717411303424", {"type": "number", "minimum": 2 ** 70},
             "2^64 or more")]:
        wrapped = {"type": "object", "properties": {"x": schema}}
        with pytest.raises(openai.BadRequestError) as caught:
            _answer(sdk, wrapped, "response_format", 0)
        message = caught.value.body["message"]
        assert f"properties.x.{where}: an integer llguidance cannot take as written " \
            f"({said}" in message, message
        assert "a double holds" not in message, message


def _required_call(sdk: openai.OpenAI, parameters: dict, choice: str, seed: int) -> dict:
    """The arguments of the one call ``tool_choice`` ``choice`` made of a tool ``f`` taking
    ``parameters``, sampled with ``seed``."""
    answer = sdk.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=200, seed=seed,
        temperature=1.0, parallel_tool_calls=False, tool_choice=choice,
        tools=[{"type": "function", "function": {"name": "f", "parameters": parameters}}])
    calls = answer.choices[0].message.tool_calls
    assert answer.choices[0].finish_reason == "tool_calls" and calls and len(calls) == 1, \
        answer
    return json.loads(calls[0].function.arguments)


#: zod-to-json-schema's default (``$refStrategy: "root"``): a schema used twice is written
#: once, then referred to by its JSON pointer from the parameters' root
ZOD_POINTER = {"type": "object", "properties": {
    "a": {"type": "integer", "minimum": 0, "maximum": 9}, "b": {"$ref": "#/properties/a"}},
    "required": ["a", "b"], "additionalProperties": False}


@pytest.mark.parametrize("choice", ["required", "auto"])
def test_a_pointer_into_the_parameters_is_resolved_in_every_tool_choice(served, choice):
    """``{"$ref": "#/properties/a"}`` (zod-to-json-schema's default for a schema used twice)
    was served with a named ``tool_choice`` only: with "required" or "auto" the parameters
    sit inside the grammar's call object, where the pointer named nothing, a 400
    ``llguidance cannot compile it: ... Pointer '/properties/a' does not exist``. It is now
    rebased onto the call's arguments."""
    needs.module("llguidance", "server")
    _, sdk = served
    if choice == "required":
        value = _required_call(sdk, ZOD_POINTER, "required", 0)
    else:  # "auto" compiles the same call grammar; its answer is the model's to choose
        answer = sdk.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8,
            tools=[{"type": "function", "function": {"name": "f", "parameters": ZOD_POINTER}}],
            tool_choice="auto")
        assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls"), answer
        return
    assert set(value) == {"a", "b"}, value
    assert all(isinstance(value[k], int) and 0 <= value[k] <= 9 for k in "ab"), value


#: a tree whose child is the parameters' own schema (``#``: the parameters' root)
TREE = {"type": "object", "properties": {
    "v": {"type": "integer", "minimum": 0, "maximum": 9},
    "child": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
    "required": ["v", "child"], "additionalProperties": False}


def _a_tree(value: object) -> bool:
    while isinstance(value, dict):
        if set(value) != {"v", "child"} or not isinstance(value["v"], int):
            return False
        value = value["child"]
    return value is None


def test_a_reference_to_the_parameters_root_is_the_parameters_not_the_call(served):
    """``{"$ref": "#"}`` in a tool's parameters names the parameters; with ``tool_choice``
    "required" (or "auto") they sit inside the grammar's call object, and ``#`` named the
    call: a tree's child had to be ``{"name": "f", "arguments": {...}}``, a value the
    parameters do not allow (seed 1 on the old code). Each child is now a node or null."""
    needs.module("llguidance", "server")
    _, sdk = served
    for seed in range(8):
        value = _required_call(sdk, TREE, "required", seed)
        assert _a_tree(value), (seed, value)
