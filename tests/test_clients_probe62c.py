"""Stop 62's third probe with real clients (the official ``openai`` SDK) against a loopback
server on the synthetic model: numbers in a JSON Schema's ranges (docs/traceability.md
"Found at stop 62 (clients, third)"). Client timeout 10 s, no retries."""

from __future__ import annotations

import json

import openai
import pytest

import needs
from test_server_support import MODEL, openai_server

TIMEOUT_S = 10.0


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with openai_server(tmp_path_factory.mktemp("calbin"), timeout=TIMEOUT_S) as (server, sdk,
                                                                                 _):
        yield server, sdk


def _refused(sdk: openai.OpenAI, schema: dict, how: str) -> dict:
    """The 400 error body of ``schema`` as a ``response_format`` or a named tool's
    parameters."""
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as caught:
        if how == "response_format":
            sdk.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=8,
                response_format={"type": "json_schema", "json_schema": {"name": "p",
                                                                        "schema": schema}})
        else:
            sdk.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=8,
                tools=[{"type": "function", "function": {"name": "p", "parameters": schema}}],
                tool_choice={"type": "function", "function": {"name": "p"}})
    return caught.value.body


def _number(key: str, value: float, kind: str = "number") -> dict:
    return {"type": "object", "properties": {"x": {"type": kind, key: value}},
            "required": ["x"]}


@pytest.mark.parametrize("schema,where", [
    pytest.param({"type": "number", "maximum": 1e19}, "maximum=1e+19", id="maximum_1e19"),
    pytest.param({"type": "number", "maximum": 1e308}, "maximum=1e+308", id="maximum_1e308"),
    pytest.param({"type": "number", "minimum": 0, "maximum": 2 ** 63},
                 "maximum=9223372036854775808", id="maximum_2_to_the_63"),
    pytest.param(_number("exclusiveMaximum", 9.3e18), "properties.x.exclusiveMaximum=9.3e+18",
                 id="nested_exclusive"),
    pytest.param(_number("minimum", 1e18), "properties.x.minimum=1e+18",
                 id="one_sided_minimum_1e18"),
    pytest.param(_number("maximum", -1e18), "properties.x.maximum=-1e+18",
                 id="one_sided_maximum_minus_1e18"),
    pytest.param(_number("minimum", 10 ** 18, "integer"), "properties.x.minimum="
                 "1000000000000000000", id="integer_minimum_1e18"),
    pytest.param({"type": "array", "items": {"anyOf": [{"type": "string"},
                                                       {"type": "number", "minimum": 2e19}]}},
                 "items.anyOf[1].minimum=2e+19", id="in_an_anyof"),
])
@pytest.mark.parametrize("how", ["response_format", "named_tool"])
def test_a_range_bound_llguidance_cannot_compile_is_a_400_naming_its_place(served, schema,
                                                                         where, how):
    """llguidance 1.9.1 writes a number's (or an integer's) range as a regex of decimal digits
    in 64-bit integers: a bound of 2^63 or more in size (``"maximum": 1e19``, ``1e308``), or a
    one-sided range from 1e18 up (or from -1e18 down), cannot be written. The client got a
    400 saying ``Failed to generate regex for float range: min=None, max=Some(1e19)``, no
    place in the schema named (a tool's parameters of many properties: which one?). Now the
    400 names the bound's place and value, says why, and how to write it."""
    needs.module("llguidance", "server")
    _, sdk = served
    error = _refused(sdk, schema, how)
    param = ("response_format.json_schema.schema" if how == "response_format"
             else "tools.0.function.parameters")
    assert error["param"] == param, error
    assert f"{param}.{where}: a range bound llguidance cannot compile" in error["message"], \
        error
    assert "both bounds" in error["message"], error
    # the server answers the next request
    answer = sdk.chat.completions.create(model=MODEL, max_tokens=4,
                                         messages=[{"role": "user", "content": "hi"}])
    assert answer.choices[0].finish_reason in ("stop", "length"), answer


@pytest.mark.parametrize("schema,where,what", [
    pytest.param({"type": "number", "multipleOf": 1e-30}, "multipleOf=1e-30",
                 "a multipleOf llguidance cannot compile", id="multiple_of_1e-30"),
    pytest.param(_number("multipleOf", 10 ** 15, "integer"),
                 "properties.x.multipleOf=1000000000000000",
                 "a multipleOf llguidance cannot compile", id="integer_multiple_of_1e15"),
    pytest.param({"type": "object", "properties": {"s": {"type": "string",
                                                         "maxLength": 2 ** 32}}},
                 "properties.s.maxLength=4294967296", "a string length llguidance cannot "
                 "compile", id="max_length_2_to_the_32"),
    pytest.param({"type": "array", "items": {"type": "string", "minLength": 10 ** 12}},
                 "items.minLength=1000000000000", "a string length llguidance cannot compile",
                 id="min_length_1e12"),
])
@pytest.mark.parametrize("how", ["response_format", "named_tool"])
def test_a_multiple_of_or_a_length_llguidance_cannot_compile_is_a_400_naming_its_place(
        served, schema, where, what, how):
    """The same for the other numbers llguidance 1.9.1 writes into a regex: a ``multipleOf``
    of many significant digits was a 400 saying ``Value for 'multipleOf' has too many
    digits: 10000000000000008`` (1e-30's), no place named; a string length past 2^32-1 was
    ``regex parse error: (?s:.{0,4294967296}) ... decimal literal invalid``, neither the
    keyword nor its place named. Now the 400 names both, and the value."""
    needs.module("llguidance", "server")
    _, sdk = served
    error = _refused(sdk, schema, how)
    param = ("response_format.json_schema.schema" if how == "response_format"
             else "tools.0.function.parameters")
    assert error["param"] == param, error
    assert f"{param}.{where}: {what}" in error["message"], error
    assert "regex parse error" not in error["message"], error


@pytest.mark.parametrize("schema", [
    pytest.param({"type": "number", "minimum": 1e18, "maximum": 2e18}, id="both_bounds_1e18"),
    pytest.param({"type": "number", "minimum": -9e18, "maximum": 9e18}, id="both_9e18"),
    pytest.param({"type": "integer", "minimum": 10 ** 18, "maximum": 2 * 10 ** 18},
                 id="integer_both_bounds"),
    pytest.param({"type": "number", "maximum": 9e18}, id="one_sided_max_9e18"),
    pytest.param({"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.25},
                 id="multiple_of_a_quarter"),
])
def test_a_range_with_both_bounds_within_2_to_the_63_is_served(served, schema):
    """What the 400 above tells the client to write is served: a value in the range."""
    needs.module("llguidance", "server")
    _, sdk = served
    answer = sdk.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=40,
        response_format={"type": "json_schema", "json_schema": {"name": "p",
                                                                "schema": schema}})
    assert answer.choices[0].finish_reason == "stop", answer
    value = json.loads(answer.choices[0].message.content)
    assert schema.get("minimum", -1e300) <= value <= schema["maximum"], value


def test_a_number_bound_below_minus_2_to_the_63_is_refused_saying_what_is_true(served):
    """``"minimum": -1e19`` on a ``number`` was refused "where its grammar compiler crashes":
    llguidance does not crash on a number's range bound (it cannot compile it: a 400 of its
    own); the crash was an integer's ``const`` or range down there. The message says which."""
    needs.module("llguidance", "server")
    _, sdk = served
    error = _refused(sdk, {"type": "number", "minimum": -1e19}, "response_format")
    message = error["message"]
    assert "response_format.json_schema.schema.minimum=-1e+19" in message, error
    assert "where its grammar compiler crashes" not in message, error
    assert "as a number's range bound it cannot compile it" in message, error
