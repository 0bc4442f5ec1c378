"""Stop 62's second probe with real clients against a loopback server on the synthetic model:
``allOf`` (OpenAPI's and code generators' inheritance) under the closing of objects that say
nothing of other keys (docs/traceability.md "Found at stop 62 (clients, second)"). Client
timeout 10 s, no retries."""

from __future__ import annotations

import copy
import json

import pytest

import needs
from calexec.drivers.serving.grammar import closed_schema
from test_server_support import MODEL, openai_server, structured_answer

TIMEOUT_S = 10.0
PET = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}},
       "required": ["name"]}
BARK = {"type": "object", "properties": {"bark": {"type": "boolean"}}, "required": ["bark"]}
#: OpenAPI's (and pydantic-style generators') inheritance: a Dog is a Pet that barks
DOG = {"$defs": {"Pet": PET}, "allOf": [{"$ref": "#/$defs/Pet"}, BARK]}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with openai_server(tmp_path_factory.mktemp("calbin"), timeout=TIMEOUT_S) as (server, sdk,
                                                                                 _):
        yield server, sdk


@pytest.mark.parametrize("how", ["response_format", "named_tool"])
@pytest.mark.parametrize("prompt", ["hi", "Invent a dog."])
def test_an_allof_inheriting_a_referenced_object_is_answered_with_both_members_keys(
        served, how, prompt):
    """``allOf: [{"$ref": "#/$defs/Pet"}, {bark}]``: on the old code the referenced ``Pet``
    was closed (it says nothing of other keys) and allOf's members are intersected, so
    ``bark`` could never be written: a 400 ``Unsatisfiable schema: required property
    'bark'``. Now the answer is a Dog, its name and its bark, nothing else."""
    needs.module("llguidance", "server")
    _, sdk = served
    text, finish = structured_answer(sdk, DOG, how, prompt)
    assert finish == "stop", text
    value = json.loads(text)
    assert set(value) == {"name", "bark"} and isinstance(value["bark"], bool), text


@pytest.mark.parametrize("how", ["response_format", "named_tool"])
@pytest.mark.parametrize("prompt", ["hi", "Invent a dog."])
def test_an_allof_of_inline_objects_is_closed_at_its_parent(served, how, prompt):
    """An ``allOf`` of objects that say nothing of other keys stayed open on the old code
    (its members are left open, each would refuse the others' keys): the model wrote keys of
    its own until ``max_tokens`` (``"length"``, no JSON). Now the parent allows the keys its
    members declare and no others."""
    needs.module("llguidance", "server")
    _, sdk = served
    text, finish = structured_answer(sdk, {"allOf": [PET, BARK]}, how, prompt)
    assert finish == "stop", text
    assert set(json.loads(text)) == {"name", "bark"}, text


@pytest.mark.parametrize("how", ["response_format", "named_tool"])
def test_an_inheritance_chain_of_references_is_closed_at_the_end(served, how):
    """A Puppy is a Dog is a Pet, each a ``$ref`` in ``$defs``, the last adding an optional
    key: every level's keys, no others (on the old code a 400: the closed Pet refused
    ``bark``)."""
    needs.module("llguidance", "server")
    _, sdk = served
    schema = {"$defs": {"Pet": PET, "Dog": {"allOf": [{"$ref": "#/$defs/Pet"}, BARK]}},
              "allOf": [{"$ref": "#/$defs/Dog"},
                        {"type": "object", "properties": {"age": {"type": "integer",
                                                                  "minimum": 0,
                                                                  "maximum": 20}},
                         "required": ["age"]}]}
    text, finish = structured_answer(sdk, schema, how)
    assert finish == "stop", text
    assert set(json.loads(text)) == {"name", "bark", "age"}, text


@pytest.mark.parametrize("strict", [False, True])
def test_a_ref_beside_an_objects_own_properties_is_merged_as_an_allof(served, strict):
    """JSON Schema 2019-09's ``$ref`` beside sibling keywords (``{"$ref": Pet, "properties":
    {bark}}``) is the same inheritance: on the old code the closed Pet refused ``bark`` and
    the closed parent refused ``name`` (a 400 ``required property 'name' is
    unsatisfiable``). With ``strict`` the ``unevaluatedProperties: false`` a strict schema
    writes beside it closes the parent on the union too (on the old code a 400
    ``Unimplemented keys``)."""
    needs.module("llguidance", "server")
    _, sdk = served
    schema = {"$defs": {"Pet": PET}, "$ref": "#/$defs/Pet", "type": "object",
              "properties": {"bark": {"type": "boolean"}}, "required": ["bark"]}
    if strict:
        schema["unevaluatedProperties"] = False
    answer = sdk.chat.completions.create(
        model=MODEL, max_tokens=120, messages=[{"role": "user", "content": "hi"}],
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema,
                                                                "strict": strict}})
    text = answer.choices[0].message.content
    assert answer.choices[0].finish_reason == "stop", text
    assert set(json.loads(text)) == {"name", "bark"}, text


def test_a_property_referencing_a_definition_still_gets_it_closed(served):
    """A ``$ref`` used as a property's schema (not an allOf member) is the closed
    definition: the nested object has its own keys only, beside an inheritance that opens
    the same definition as a member."""
    needs.module("llguidance", "server")
    _, sdk = served
    schema = {"$defs": {"Pet": PET},
              "allOf": [{"$ref": "#/$defs/Pet"},
                        {"type": "object", "properties": {"friend": {"$ref": "#/$defs/Pet"}},
                         "required": ["friend"]}]}
    text, finish = structured_answer(sdk, schema, "response_format")
    value = json.loads(text)
    assert finish == "stop" and set(value) == {"name", "friend"}, text
    assert set(value["friend"]) == {"name"}, text


def test_anyof_members_are_each_closed(served):
    """``anyOf``/``oneOf`` members stay closed each (one of them is the answer, with its own
    keys), including a member that is an inheritance."""
    needs.module("llguidance", "server")
    _, sdk = served
    for key in ("anyOf", "oneOf"):
        schema = {"$defs": {"Pet": PET},
                  key: [{"allOf": [{"$ref": "#/$defs/Pet"}, BARK]},
                        {"type": "object", "properties": {"meow": {"type": "boolean"}},
                         "required": ["meow"]}]}
        text, finish = structured_answer(sdk, schema, "response_format")
        assert finish == "stop", text
        assert set(json.loads(text)) in ({"name", "bark"}, {"meow"}), text


def test_an_allof_whose_member_says_it_is_open_stays_open(served):
    """What a member says is kept: one with ``additionalProperties: true`` leaves the
    parent open (the greedy model adds a key after the declared ones)."""
    needs.module("llguidance", "server")
    _, sdk = served
    text, _ = structured_answer(sdk, {"allOf": [{**BARK, "additionalProperties": True}]},
                                "response_format")
    assert text.startswith('{"bark":false,"'), text


def test_closed_schema_closes_an_allof_at_its_parent_and_opens_its_members():
    """The rewrite: the parent gets the union of its members' keys (their ``$ref``'d
    definitions' too) and ``additionalProperties: false``; a ``$ref`` member points to an
    open copy of the definition, which itself stays closed for other uses; the request's
    schema is left as it was."""
    given = copy.deepcopy(DOG)
    out = closed_schema(DOG)
    assert DOG == given
    assert out["additionalProperties"] is False
    assert set(out["properties"]) == {"name", "bark"}
    assert out["$defs"]["Pet"]["additionalProperties"] is False
    member = out["allOf"][0]["$ref"]
    assert member.startswith("#/$defs/") and member != "#/$defs/Pet"
    opened = out["$defs"][member.split("/")[-1]]
    assert "additionalProperties" not in opened and opened["properties"] == PET["properties"]
    assert "additionalProperties" not in out["allOf"][1]
    # an allOf that declares no keys stays any object, as {"type": "object"} does
    assert closed_schema({"allOf": [{"type": "object"}]}) == {"allOf": [{"type": "object"}]}
    # unevaluatedProperties: false beside an allOf means what it says: closed on the union
    said = closed_schema({"allOf": [PET, BARK], "unevaluatedProperties": False})
    assert said["additionalProperties"] is False and set(said["properties"]) == {"name",
                                                                                  "bark"}


def test_closed_schema_opens_each_definition_once_and_survives_cycles():
    """Definitions inheriting each other twice over (a diamond 40 deep) are opened once each,
    not once per path (2^40), and a definition inheriting itself ends."""
    defs = {f"D{i}": {"allOf": [{"$ref": f"#/$defs/D{i + 1}"}, {"$ref": f"#/$defs/D{i + 1}"}],
                      "properties": {f"k{i}": {"type": "boolean"}}} for i in range(40)}
    defs["D40"] = {"type": "object", "properties": {"end": {"type": "boolean"}}}
    out = closed_schema({"$defs": defs, "$ref": "#/$defs/D0"})
    assert len(json.dumps(out)) < 40 * len(json.dumps(defs))
    assert set(out["$defs"]["D0"]["properties"]) == {f"k{i}" for i in range(40)} | {"end"}
    loop = closed_schema({"$defs": {"A": {"allOf": [{"$ref": "#/$defs/A"}],
                                          "properties": {"a": {"type": "boolean"}}}},
                          "$ref": "#/$defs/A"})
    assert loop["$defs"]["A"]["additionalProperties"] is False
