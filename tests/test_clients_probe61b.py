"""Stop 61's second probe with real clients (the official ``openai`` SDK, langchain-openai)
against a loopback server on the synthetic model: structured outputs as vLLM answers them
(docs/traceability.md "Found at stop 61 (clients, second)"). vLLM's default structured-output
backend (xgrammar, ``strict_mode=True``) allows no key an object schema does not declare and no
item past a ``prefixItems`` tuple unless the schema says so; llguidance follows JSON Schema's
default (anything more is allowed), so the greedy synthetic model wrote keys of its own until
``max_tokens``. Client timeout 10 s, no retries."""

from __future__ import annotations

import copy
import json

import openai
import pydantic
import pytest

import needs
from calexec.drivers.serving.grammar import closed_schema
from test_server_support import MODEL, openai_server, structured_answer

TIMEOUT_S = 10.0
#: an object schema as a client writes it: declared properties, nothing said of others
AGE = {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0,
                                                "maximum": 150}}, "required": ["age"]}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0,
                                                   "maximum": 150}},
          "required": ["name", "age"]}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with openai_server(tmp_path_factory.mktemp("calbin"), timeout=TIMEOUT_S) as (server, sdk,
                                                                                 _):
        yield server, sdk


@pytest.mark.parametrize("prompt,schema", [
    pytest.param("hi", AGE, id="age"),
    pytest.param("hi", PERSON, id="person"),
    pytest.param("Invent a person.", PERSON, id="person_invented"),
])
@pytest.mark.parametrize("how", ["response_format", "named_tool"])
def test_an_object_schema_that_says_nothing_of_other_keys_gets_none(served, prompt, schema,
                                                                      how):
    """A schema without ``additionalProperties`` (what pydantic, zod and most hand-written
    schemas send unless asked for ``strict``) is closed, as vLLM's default backend closes it:
    the answer is one JSON object with the declared keys only, ``finish_reason: stop``. On
    the old code the model added keys of its own (``{"age":48,"l~mu-...`` until
    ``max_tokens``: ``"length"``, not JSON)."""
    needs.module("llguidance", "server")
    _, sdk = served
    text, finish = structured_answer(sdk, schema, how, prompt)
    assert finish == "stop", text
    value = json.loads(text)
    assert set(value) == set(schema["required"]), text


def test_langchain_function_calling_without_strict_parses_into_the_model(served):
    """langchain's ``with_structured_output(Model, method="function_calling")`` without
    ``strict`` sends the pydantic schema as a named tool's parameters, no
    ``additionalProperties``: on the old code the call's arguments went on with keys the
    model made up until ``max_tokens``, the answer had no call and the parse gave None; now
    it is the model."""
    needs.module("llguidance", "server")
    langchain_openai = needs.module("langchain_openai", "clients")
    server, _ = served

    class Person(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=12)
        age: int = pydantic.Field(ge=0, le=150)

    chat = langchain_openai.ChatOpenAI(model=MODEL, base_url=f"{server.url}/v1",
                                       api_key="unused", temperature=0, max_tokens=200,
                                       timeout=TIMEOUT_S, max_retries=0)
    person = chat.with_structured_output(Person, method="function_calling").invoke(
        "Invent a person.")
    assert isinstance(person, Person), person


def test_unevaluated_properties_false_closes_an_object(served):
    """``"unevaluatedProperties": false`` (JSON Schema 2019-09's way to close an object,
    which xgrammar honours) was ignored by llguidance: the named call's arguments went on
    with the model's own keys (``{"a":false,"=...``); without an applicator beside it, it now
    closes the object as ``additionalProperties: false`` does."""
    needs.module("llguidance", "server")
    _, sdk = served
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"],
              "unevaluatedProperties": False}
    text, finish = structured_answer(sdk, schema, "named_tool")
    assert (json.loads(text), finish) == ({"a": False}, "stop"), text


def test_a_tuple_without_items_gets_no_item_past_it(served):
    """``prefixItems`` without ``items``: vLLM's default backend allows nothing past the
    tuple (``unevaluatedItems`` false in strict mode); llguidance allowed any items after."""
    needs.module("llguidance", "server")
    _, sdk = served
    schema = {"type": "object", "properties": {"t": {
        "type": "array", "prefixItems": [{"type": "boolean"}, {"enum": ["x", "y"]}]}},
        "required": ["t"]}
    for how in ("response_format", "named_tool"):
        text, finish = structured_answer(sdk, schema, how)
        value = json.loads(text)
        assert len(value["t"]) <= 2 and finish == "stop", text


def test_an_object_that_says_it_is_open_stays_open(served):
    """What a schema says is kept: ``additionalProperties: true`` lets the model add keys (the
    greedy synthetic model does, after the declared one), and ``{"type": "object"}`` with no
    properties (``json_object``) is any object."""
    needs.module("llguidance", "server")
    _, sdk = served
    text, _ = structured_answer(sdk, {**AGE, "additionalProperties": True}, "response_format")
    assert text.startswith('{"age":48,"'), text


def test_closed_schema_closes_what_says_nothing_and_keeps_what_is_said():
    """The rewrite itself (the request's schema left as it was): every object with
    properties, wherever it is (``$defs``, ``anyOf``, array ``items``, nested properties);
    not the members of an ``allOf`` (each would refuse the others' keys), their insides yes;
    ``unevaluatedProperties`` moved to ``additionalProperties`` only without an applicator
    beside it."""
    inner = {"type": "object", "properties": {"k": {"type": "boolean"}}}
    schema = {"type": "object",
              "$defs": {"D": copy.deepcopy(inner)},
              "properties": {
                  "n": copy.deepcopy(inner),
                  "l": {"type": "array", "items": copy.deepcopy(inner)},
                  "u": {"anyOf": [copy.deepcopy(inner), {"type": "null"}]},
                  "t": {"type": "array", "prefixItems": [{"type": "boolean"}]},
                  "open": {**copy.deepcopy(inner), "additionalProperties": True},
                  "typed": {**copy.deepcopy(inner), "additionalProperties": {"type": "integer"}},
                  "any": {"type": "object"},
                  "both": {"allOf": [{"properties": {"x": {"type": "boolean"}}},
                                     {"properties": {"y": copy.deepcopy(inner)}}]},
                  "uneval": {**copy.deepcopy(inner), "unevaluatedProperties": False},
                  "uneval_ref": {"$ref": "#/$defs/D", "unevaluatedProperties": False},
              }}
    given = copy.deepcopy(schema)
    out = closed_schema(schema)
    assert schema == given  # not changed in place
    props = out["properties"]
    assert out["additionalProperties"] is False
    assert out["$defs"]["D"]["additionalProperties"] is False
    assert props["n"]["additionalProperties"] is False
    assert props["l"]["items"]["additionalProperties"] is False
    assert props["u"]["anyOf"][0]["additionalProperties"] is False
    assert props["t"]["items"] is False
    assert props["open"]["additionalProperties"] is True
    assert props["typed"]["additionalProperties"] == {"type": "integer"}
    assert props["any"] == {"type": "object"}
    assert [set(m) for m in props["both"]["allOf"]] == [{"properties"}, {"properties"}]
    assert props["both"]["allOf"][1]["properties"]["y"]["additionalProperties"] is False
    assert props["uneval"]["additionalProperties"] is False
    assert "unevaluatedProperties" not in props["uneval"]
    # since stop 64 a $ref beside unevaluatedProperties is merged (it was left beside it, for
    # llguidance to ignore): closed on the definition's keys, the definition open under it
    assert props["uneval_ref"] == {"$ref": "#/$defs/open.D", "properties": {"k": {}},
                                   "additionalProperties": False}
    # a property named like a keyword is a name, not a keyword
    named = closed_schema({"type": "object", "properties": {"items": {"type": "boolean"}}})
    assert named["properties"] == {"items": {"type": "boolean"}}
    assert closed_schema(True) is True and closed_schema([1, "a"]) == [1, "a"]


@pytest.mark.parametrize("schema,where", [
    pytest.param({"type": "array", "items": {"type": "boolean"}, "maxItems": 10 ** 30},
                 "schema.maxItems=1000000000000000000000000000000", id="maxItems"),
    pytest.param({"type": "object", "properties": {"n": {"type": "integer",
                                                         "minimum": 2 ** 64}}},
                 "schema.properties.n.minimum=18446744073709551616", id="minimum"),
    pytest.param({"enum": [1, -(2 ** 63) - 1]}, "schema.enum[1]=-9223372036854775809",
                 id="enum"),
    pytest.param({"const": 2 ** 53 + 1}, "schema.const=9007199254740993", id="const_inexact"),
    pytest.param({"type": "integer", "minimum": 12345678901234567,
                  "maximum": 12345678901234567},
                 "schema.maximum=12345678901234567", id="bounds_inexact"),
])
def test_an_integer_llguidance_cannot_keep_is_a_400_naming_where_it_is(served, schema, where):
    """JSON has no integer bound; llguidance refused one past 64 bits as ``Value is not
    JSON serializable: 1000...``, which the client's valid JSON is not, with no place named,
    and read the others as doubles: ``{"const": 9007199254740993}`` was answered
    ``9007199254740992`` and ``minimum`` = ``maximum`` = 12345678901234567 answered
    ``12345678901234568``, values the schema did not allow, ``finish_reason: stop``; now the
    400 names the field, the number's place and why."""
    needs.module("llguidance", "server")
    _, sdk = served
    error = _refused(sdk, schema)
    assert f"response_format.json_schema.{where}: an integer llguidance cannot take" \
        in error["message"], error
    assert "not JSON serializable" not in error["message"]


@pytest.mark.parametrize("schema,where,what", [
    pytest.param({"const": -(2 ** 63)}, "schema.const=-9223372036854775808", "an integer",
                 id="const"),
    pytest.param({"type": "object", "properties": {"a": {"enum": [1, -(2 ** 63) + 512]}}},
                 "schema.properties.a.enum[1]=-9223372036854775296", "an integer", id="enum"),
    pytest.param({"const": {"a": [-(2 ** 63)]}}, "schema.const.a[0]=-9223372036854775808",
                 "an integer", id="nested_const"),
    pytest.param({"type": "integer", "const": -1e30}, "schema.const=-1e+30", "a number",
                 id="float"),
    pytest.param({"type": "integer", "minimum": -9.3e18, "maximum": -9.25e18},
                 "schema.maximum=-9.25e+18", "a number", id="float_range"),
])
def test_an_integer_near_minus_2_to_the_63_is_a_400_not_a_crash(served, schema, where, what):
    """``{"const": -9223372036854775808}`` (i64's least, a valid JSON number; any integer
    within 512 of it, in an ``enum`` or a nested ``const`` alike; a float at or below
    -2^63+1024 as an integer's ``const`` or range) crashed llguidance's grammar compiler
    with SIGSEGV: one request killed the whole server process. It is a 400 naming the
    number's place now, and the server answers the next request."""
    needs.module("llguidance", "server")
    _, sdk = served
    error = _refused(sdk, schema)
    assert f"response_format.json_schema.{where}: {what} llguidance cannot take" \
        in error["message"], error
    # the least integer it takes is served, and so is the next request (10^19, not 2^63: from
    # 2^63 up a number is written as a double's shortest digits, 2^63 as 9223372036854776000,
    # a 400 since stop 64)
    fine = {"enum": [-(2 ** 63) + 2 ** 11, 10 ** 19, 2 ** 53]}
    answer = sdk.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=30,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": fine}})
    assert json.loads(answer.choices[0].message.content) in fine["enum"], answer


def _refused(sdk: openai.OpenAI, schema: dict) -> dict:
    """The 400 error body of ``schema`` as a ``response_format``."""
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8,
            response_format={"type": "json_schema", "json_schema": {"name": "p",
                                                                    "schema": schema}})
    error = caught.value.body
    assert error["param"] == "response_format.json_schema.schema", error
    return error
