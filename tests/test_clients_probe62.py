"""Stop 62's probe with real clients (the official ``openai`` SDK's ``.parse()``) against a
loopback server on the synthetic model: structured outputs as vLLM answers them
(docs/traceability.md "Found at stop 62 (clients)"). Client timeout 10 s, no retries."""

from __future__ import annotations

import json
import re

import openai
import pydantic
import pytest

import needs
from test_server_support import MODEL, openai_server

TIMEOUT_S = 10.0


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with openai_server(tmp_path_factory.mktemp("calbin"), timeout=TIMEOUT_S) as (server, sdk,
                                                                                 _):
        yield server, sdk


@pytest.mark.parametrize("pattern,whole", [
    pytest.param("[a-z]+", r"[a-z]+", id="letters"),
    pytest.param("[0-9]{3}", r"[0-9]{3}", id="three_digits"),
    pytest.param("a|b", r"a|b", id="alternation"),
    pytest.param("^[A-Z]", r"[A-Z]", id="anchored_at_the_start_only"),
])
@pytest.mark.parametrize("prompt", ["hi", "Invent a code."])
def test_a_pattern_is_matched_against_the_whole_string_as_vllm_matches_it(served, pattern,
                                                                          whole, prompt):
    """vLLM's default structured-output backend (xgrammar) matches a ``pattern`` against the
    whole string (its leading ``^``/trailing ``$`` dropped); llguidance matches it anywhere,
    as JSON Schema says, so on the old code a pydantic ``Field(pattern="[a-z]+")`` parsed by
    the SDK was answered ``"Y'wV}x4.us"`` (``[0-9]{3}``: ``"Y'wV}x452\\x8c"``): a value a
    vLLM user never gets, and one the model's own pydantic validation (which is
    ``re.match``, a match at the start) refuses."""
    needs.module("llguidance", "server")
    _, sdk = served

    class Code(pydantic.BaseModel):
        code: str = pydantic.Field(pattern=pattern, max_length=10)

    answer = sdk.chat.completions.parse(model=MODEL, max_tokens=60, response_format=Code,
                                        messages=[{"role": "user", "content": prompt}])
    choice = answer.choices[0]
    assert choice.finish_reason == "stop", choice
    code = json.loads(choice.message.content)["code"]
    assert re.fullmatch(whole, code), code
    assert choice.message.parsed == Code(code=code)


def test_a_pattern_property_key_is_matched_against_the_whole_key(served):
    """xgrammar matches a ``patternProperties`` key's pattern against the whole key too; on
    the old code the model's keys only had to hold ``k[0-9]`` somewhere."""
    needs.module("llguidance", "server")
    _, sdk = served
    schema = {"type": "object", "patternProperties": {"k[0-9]": {"type": "boolean"}},
              "minProperties": 1, "maxProperties": 2}
    answer = sdk.chat.completions.create(
        model=MODEL, max_tokens=60, messages=[{"role": "user", "content": "hi"}],
        response_format={"type": "json_schema", "json_schema": {"name": "k", "schema": schema}})
    value = json.loads(answer.choices[0].message.content)
    assert value and all(re.fullmatch(r"k[0-9]", key) for key in value), value


@pytest.mark.parametrize("pattern", ["a)(b", "(a", "[a-"])
def test_a_pattern_that_is_no_regex_is_still_refused_naming_the_schema(served, pattern):
    """Anchoring wraps the pattern in ``^(?:...)$``: a pattern whose parentheses do not nest
    is left as it is, so it is still a 400 (``a)(b`` wrapped would be a regex)."""
    needs.module("llguidance", "server")
    _, sdk = served
    schema = {"type": "object", "properties": {"s": {"type": "string", "pattern": pattern}},
              "required": ["s"]}
    with pytest.raises(openai.BadRequestError) as err:
        sdk.chat.completions.create(
            model=MODEL, max_tokens=20, messages=[{"role": "user", "content": "hi"}],
            response_format={"type": "json_schema", "json_schema": {"name": "s",
                                                                    "schema": schema}})
    assert err.value.body["param"] == "response_format.json_schema.schema", err.value.body
