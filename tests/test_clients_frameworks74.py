"""Stop 74's client frameworks driven themselves against a loopback server (docs/server.md "Real
clients"): DSPy, haystack, autogen, langgraph and mirascope, each used as its docs show with
the server's base URL. None is a dependency of calexec: each test skips naming the ``pip
install`` when its library is absent (``.ci/clients`` installs them and allows no skip);
tests/test_clients_probe74.py replays what they send without them."""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import pytest

import needs
from test_server_support import MODEL, live_fixture  # noqa: F401 - the ``live`` fixture

needs.module("httpx", "server")
pydantic = needs.module("pydantic", "server")


class Answer(pydantic.BaseModel):
    answer: int
    sure: bool


CITIES = ("Paris", "Rome")


def weather(city: Literal["Paris", "Rome"]) -> str:
    """Weather of a city."""
    return f"sunny in {city}"


def library(name: str, install: str):
    return needs.module(name, "clients", install=f"pip install {install} (not an extra of "
                        "calexec: .ci/clients installs it)")


def test_dspy_predicts_a_typed_signature_through_the_json_adapters_structured_output(live):
    """DSPy 3.4's own engine (lm15) with a provider declared as supporting response schemas
    sends the signature as a strict ``json_schema``; the grammar's answer parses into the
    signature's types, sync and ``acall``; ``openai/`` without a declaration answers plain text,
    and a prompt past the context raises DSPy's ``ContextWindowExceededError``."""
    dspy = library("dspy", "dspy==3.4.1")
    from dspy._vendor.lm15.compat import OpenAIChatCompat
    from dspy._vendor.lm15.features import AccessPolicy
    from dspy.lm15 import ModelSupport, ProviderDefinition, register_provider
    from dspy.utils.exceptions import ContextWindowExceededError
    server, _, _ = live
    base = f"{server.url}/v1"
    register_provider(ProviderDefinition.chat(
        AccessPolicy(provider="calexec74", env_keys=("CALEXEC74_KEY",), base_url=base),
        compat=OpenAIChatCompat.preset("vllm")),
        supports=ModelSupport(function_calling=True, response_schema=True), replace=True)

    class QA(dspy.Signature):
        """Answer."""
        question: str = dspy.InputField()
        answer: int = dspy.OutputField()
        sure: bool = dspy.OutputField()

    lm = dspy.LM(f"calexec74/{MODEL}", api_base=base, api_key="x", cache=False, max_tokens=96,
                 num_retries=0)
    with dspy.context(lm=lm, adapter=dspy.JSONAdapter()):
        whole = dspy.Predict(QA)(question="2+2?")
        awaited = asyncio.run(dspy.Predict(QA).acall(question="2+2?"))
    assert isinstance(whole.answer, int) and isinstance(whole.sure, bool)
    assert (awaited.answer, awaited.sure) == (whole.answer, whole.sure)  # greedy: the same
    plain = dspy.LM(f"openai/{MODEL}", api_base=base, api_key="x", cache=False, max_tokens=8,
                    num_retries=0)
    [text] = plain("hi")
    assert isinstance(text, str) and text
    with pytest.raises(ContextWindowExceededError, match="context_length_exceeded"):
        plain("x" * 41000)


def test_haystack_chat_generator_tools_structured_output_and_streaming(live):
    """haystack 3.4's ``OpenAIChatGenerator`` with ``api_base_url``: a required tool call whose
    arguments are the tool's, its result sent back as a tool message and answered; a pydantic
    ``response_format`` parsed; a streamed reply whose chunks join to the reply's text."""
    library("haystack", "haystack-ai==3.4.1")
    from haystack.components.generators.chat import OpenAIChatGenerator
    from haystack.dataclasses import ChatMessage
    from haystack.tools import Tool
    from haystack.utils import Secret
    server, _, _ = live
    key, base = Secret.from_token("x"), f"{server.url}/v1"
    tool = Tool(name="weather", description="weather of a city", function=weather,
                parameters={"type": "object", "required": ["city"],
                            "properties": {"city": {"type": "string", "enum": list(CITIES)}}})
    forced = OpenAIChatGenerator(api_key=key, model=MODEL, api_base_url=base, tools=[tool],
                                 generation_kwargs={"max_tokens": 64, "tool_choice": "required"})
    question = ChatMessage.from_user("weather in Paris?")
    reply = forced.run([question])["replies"][0]
    assert reply.tool_calls and reply.tool_calls[0].arguments["city"] in CITIES
    results = [ChatMessage.from_tool(weather(**call.arguments), origin=call)
               for call in reply.tool_calls]
    free = OpenAIChatGenerator(api_key=key, model=MODEL, api_base_url=base, tools=[tool],
                               generation_kwargs={"max_tokens": 8})
    assert free.run([question, reply, *results])["replies"][0].meta["finish_reason"] in (
        "stop", "length", "tool_calls")
    structured = OpenAIChatGenerator(api_key=key, model=MODEL, api_base_url=base,
                                     generation_kwargs={"max_tokens": 64,
                                                        "response_format": Answer})
    Answer.model_validate_json(structured.run([ChatMessage.from_user("2+2")])["replies"][0].text)
    chunks: list = []
    streamed = OpenAIChatGenerator(api_key=key, model=MODEL, api_base_url=base,
                                   streaming_callback=chunks.append,
                                   generation_kwargs={"max_tokens": 8})
    text = streamed.run([ChatMessage.from_user("hi")])["replies"][0].text
    assert "".join(c.content for c in chunks) == text and chunks[-1].finish_reason == "length"


def test_autogen_client_calls_a_tool_and_answers_a_typed_output(live):
    """autogen 0.7's ``OpenAIChatCompletionClient`` (``model_info`` given): ``tool_choice``
    required gives the tool's call, the ``FunctionExecutionResultMessage`` turn is answered,
    ``json_output`` of a pydantic model parses, a stream's last item is the whole result."""
    library("autogen_ext.models.openai", "autogen-agentchat==0.7.5 'autogen-ext[openai]==0.7.5'")
    from autogen_core.models import (
        AssistantMessage,
        FunctionExecutionResult,
        FunctionExecutionResultMessage,
        ModelInfo,
        UserMessage,
    )
    from autogen_core.tools import FunctionTool
    from autogen_ext.models.openai import OpenAIChatCompletionClient
    server, _, _ = live
    info = ModelInfo(vision=False, function_calling=True, json_output=True, family="unknown",
                     structured_output=True)
    client = OpenAIChatCompletionClient(model=MODEL, base_url=f"{server.url}/v1", api_key="x",
                                        model_info=info, max_tokens=64, max_retries=0)
    tool = FunctionTool(weather, description="Weather of a city.")

    async def run() -> None:
        messages: list = [UserMessage(content="weather?", source="user")]
        called = await client.create(messages, tools=[tool], tool_choice="required")
        assert isinstance(called.content, list) and called.content
        call = called.content[0]
        assert json.loads(call.arguments)["city"] in CITIES
        messages += [AssistantMessage(content=called.content, source="assistant"),
                     FunctionExecutionResultMessage(content=[FunctionExecutionResult(
                         content=weather(**json.loads(call.arguments)), call_id=call.id,
                         is_error=False, name=call.name)])]
        answered = await client.create(messages, tools=[tool])
        assert answered.finish_reason in ("stop", "length", "function_calls")
        typed = await client.create([UserMessage(content="2+2", source="user")],
                                    json_output=Answer)
        Answer.model_validate_json(typed.content)
        items = [item async for item in client.create_stream(
            [UserMessage(content="hi", source="user")], include_usage=True)]
        assert items[-1].usage.completion_tokens == 64
        assert "".join(items[:-1]) == items[-1].content
    asyncio.run(run())


def test_langgraph_react_agent_runs_its_tool_and_returns_a_structured_response(live):
    """langgraph's prebuilt ReAct agent over langchain-openai's ``ChatOpenAI``: a forced tool
    is called with its schema's arguments and run, until the step limit ends the loop;
    ``response_format`` gives a ``structured_response`` of the model."""
    library("langgraph.prebuilt", "langgraph==1.2.24")
    from langchain_core.tools import tool as lc_tool
    from langchain_openai import ChatOpenAI
    from langgraph.prebuilt import create_react_agent
    server, _, _ = live
    llm = ChatOpenAI(model=MODEL, base_url=f"{server.url}/v1", api_key="x", max_tokens=64,
                     max_retries=0, timeout=30)
    tool = lc_tool(weather)
    forced = create_react_agent(llm.bind_tools([tool], tool_choice="weather"), [tool])
    ran = forced.invoke({"messages": [("user", "weather?")]}, {"recursion_limit": 4})
    results = [m.content for m in ran["messages"] if m.type == "tool"]
    assert results and set(results) <= {weather(city) for city in CITIES}  # type: ignore[arg-type]
    agent = create_react_agent(llm, [tool], response_format=Answer)
    assert isinstance(agent.invoke({"messages": [("user", "2+2")]})["structured_response"],
                      Answer)


def test_mirascope_call_formats_a_model_and_streams(live):
    """mirascope 2's ``llm.call`` over its openai provider registered at the server's URL:
    ``format=`` a pydantic model parses; a stream's text and usage are the whole answer's."""
    llm = library("mirascope.llm", "mirascope==2.8.2")
    server, _, _ = live
    llm.register_provider("openai", scope="calexec74/", api_key="x",
                          base_url=f"{server.url}/v1")

    @llm.call(f"calexec74/{MODEL}", format=Answer, max_tokens=64)
    def typed(question: str) -> str:
        return question

    assert isinstance(typed("2+2").parse(), Answer)

    @llm.call(f"calexec74/{MODEL}", max_tokens=8)
    def say(word: str) -> str:
        return f"say {word}"

    whole = say("hi").text()
    stream = say.stream("hi")
    assert "".join(stream.text_stream()).rstrip("\n") == whole  # mirascope ends a part so
    assert stream.usage.output_tokens == 8
