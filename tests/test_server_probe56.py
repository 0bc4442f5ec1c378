"""Stop 56, the server's probe: each defect pinned here (docs/traceability.md "Found at stop
56 (server)"). Real executor on the bundled emulator; every wait bounded."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import httpx
import pytest

from calexec.contracts.fields import shown
from calexec.drivers.serving.server import ServerConfig, create_app
from calexec.drivers.synthetic.calbin import MAX_SEQ, VOCAB
from test_server_support import (
    LiveServer,
    bos_tokenizer,
    free_port,
    live_fixture,  # noqa: F401 - the fixture `live`
    started_executor,
    wait_for,
)

MODEL = "calexec-qwen3-synthetic"
CHAT = {"messages": [{"role": "user", "content": "hello"}]}
PROMPT = {"prompt": [300, 301, 302]}


def templated_tokenizer(tmp_path, template: str | None = None):
    """A tokenizer.json of two words in ``tmp_path`` (a ``--tokenizer`` directory), its
    ``tokenizer_config.json`` holding ``template`` as the chat template when given; the
    directory loaded (``hf_tokenizer.load``) when a template is given. Skips without the
    ``[tokenizer]`` extra (tokenizers, jinja2)."""
    tokenizers = pytest.importorskip("tokenizers")
    pytest.importorskip("jinja2")
    from tokenizers import models, pre_tokenizers

    from calexec.drivers.serving import hf_tokenizer
    tok = tokenizers.Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 5}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    if template is None:
        return None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return hf_tokenizer.load(str(tmp_path))


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
@pytest.mark.parametrize("keep", [MAX_SEQ + 1, 10**30], ids=["context+1", "huge"])
def test_truncate_prompt_tokens_above_the_context_is_a_400_naming_it_and_the_limit(
        live, route, keep):
    """``truncate_prompt_tokens`` above the model's context (``max_model_len``) was taken
    and truncated nothing: a client sizing it to a model it thought larger got its long
    prompt refused for its length (or a short one served) with no word about the field.
    vLLM refuses it ("truncate_prompt_tokens value is greater than max_model_len"); both
    routes now answer a 400 naming the field, the value and the limit."""
    server, _, _ = live
    body = {"model": MODEL, "max_tokens": 1, "truncate_prompt_tokens": keep,
            **(PROMPT if route == "completions" else CHAT)}
    r = httpx.post(f"{server.url}/v1/{route}", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "truncate_prompt_tokens", error
    assert f"truncate_prompt_tokens={keep}" in error["message"], error
    assert f"max_model_len={MAX_SEQ}" in error["message"], error


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_truncate_prompt_tokens_of_the_whole_context_is_still_taken(live, route):
    server, _, _ = live
    body = {"model": MODEL, "max_tokens": 1, "truncate_prompt_tokens": MAX_SEQ,
            **(PROMPT if route == "completions" else CHAT)}
    r = httpx.post(f"{server.url}/v1/{route}", json=body, timeout=30)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_a_top_k_at_or_above_the_vocabulary_samples_as_top_k_off(live, route):
    """``top_k`` has no upper bound (docs/server.md's table, as vLLM, which clamps it to the
    vocabulary): a k of the vocabulary's size or any larger integer keeps every token, so a
    seeded draw is the draw with top-k off, on both routes."""
    server, _, _ = live
    base = {"model": MODEL, "max_tokens": 6, "temperature": 1.5, "seed": 7,
            **(PROMPT if route == "completions" else CHAT)}

    def drawn(top_k: int) -> list[int]:
        r = httpx.post(f"{server.url}/v1/{route}", json={**base, "top_k": top_k}, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]

    off = drawn(-1)
    assert drawn(VOCAB) == off and drawn(10**30) == off
    assert drawn(VOCAB - 1) != off or drawn(2) != off  # (a real k does cut: the draw can see it)


@pytest.mark.parametrize("decoder", [None, "WordPiece"])
def test_a_tokenizer_llguidance_cannot_load_makes_structured_fields_a_400_naming_them(
        tmp_path, decoder):
    """``--tokenizer`` takes any ``tokenizer.json`` the ``tokenizers`` library loads, but
    llguidance builds a grammar's vocabulary only from one whose decoder is ByteLevel or
    Metaspace: with a WordPiece decoder (or none) every request with ``response_format``
    (json types) or ``tools`` was a 500 ``server.unexpected_error`` (ValueError "can't
    determine decoder type", the tokenizer read again each time). It is now a 400 naming the
    field and llguidance's reason, as when llguidance is not installed; text requests are
    served as before."""
    pytest.importorskip("llguidance")
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers
    tok = tokenizers.Tokenizer(models.WordLevel(
        {"[UNK]": 0, "hello": 5, "user": 6, ":": 7, "assistant": 8, "{": 9, "}": 10},
        unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if decoder is not None:
        tok.decoder = getattr(decoders, decoder)()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    executor = started_executor(tmp_path)
    app = create_app(executor, ServerConfig(tokenizer_path=str(path)))
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    asks = [("completions", {"prompt": "hello", "response_format": {"type": "json_object"}},
             "response_format"),
            ("chat/completions", {**CHAT, "response_format": {"type": "json_object"}},
             "response_format"),
            ("chat/completions", {**CHAT, "tools": [tool], "tool_choice": "required"}, "tools")]
    try:
        with LiveServer(app) as server:
            for _ in range(2):  # (the second time from the kept refusal)
                for route, body, param in asks:
                    r = httpx.post(f"{server.url}/v1/{route}",
                                   json={"model": MODEL, "max_tokens": 2, **body}, timeout=30)
                    assert r.status_code == 400, (route, r.text)
                    error = r.json()["error"]
                    assert error["param"] == param, error
                    assert "llguidance cannot load" in error["message"], error
                    # (as the server shows a name: elided past 80 characters, which an xdist
                    # worker's longer tmp_path reaches)
                    assert shown(str(path)) in error["message"], error
            r = httpx.post(f"{server.url}/v1/completions",
                           json={"model": MODEL, "max_tokens": 2, "prompt": "hello"}, timeout=30)
            assert r.status_code == 200, r.text
    finally:
        executor.shutdown(5.0)


def test_tokenize_counts_a_chat_as_the_chat_route_with_its_special_tokens_and_continuation(
        tmp_path):
    """``/tokenize`` is documented to count a chat as the chat route renders it (its
    ``prompt_tokens``), but with ``messages`` it took ``add_special_tokens: true`` and ignored
    it (8 tokens where the chat counts 9 with the tokenizer's BOS), and refused vLLM's
    ``continue_final_message`` as an unknown parameter. Both now render as chat does; a
    prompt still gets its special tokens by default, and ``continue_final_message``
    without ``messages`` is named."""
    path = bos_tokenizer(tmp_path / "tokenizer.json")
    executor = started_executor(tmp_path)
    app = create_app(executor, ServerConfig(tokenizer_path=str(path)))
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hello"}]
    try:
        with LiveServer(app) as server:
            def chat_ids(**extra) -> list[int]:
                r = httpx.post(f"{server.url}/v1/chat/completions", timeout=30, json={
                    "model": MODEL, "messages": messages, "max_tokens": 1,
                    "return_token_ids": True, **extra})
                assert r.status_code == 200, r.text
                return r.json()["prompt_token_ids"]

            def counted(**body) -> list[int]:
                r = httpx.post(f"{server.url}/tokenize", json=body, timeout=30)
                assert r.status_code == 200, r.text
                return r.json()["tokens"]

            for extra in ({}, {"add_special_tokens": True}, {"add_special_tokens": False},
                          {"continue_final_message": True, "add_generation_prompt": False}):
                assert counted(messages=messages, **extra) == chat_ids(**extra), extra
            assert chat_ids(add_special_tokens=True)[0] == 1
            assert counted(prompt="hello") == [1, 5]  # a prompt: true by default, as ever
            assert counted(prompt="hello", add_special_tokens=False) == [5]
            r = httpx.post(f"{server.url}/tokenize", timeout=30,
                           json={"prompt": "hello", "continue_final_message": True})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == "continue_final_message", r.text
            r = httpx.post(f"{server.url}/tokenize", timeout=30,
                           json={"messages": messages, "continue_final_message": True})
            assert r.status_code == 400, r.text  # as chat: needs add_generation_prompt false
            assert r.json()["error"]["param"] == "continue_final_message", r.text
    finally:
        executor.shutdown(5.0)


@pytest.mark.parametrize(("value", "problem"), [
    ("", "is empty"), ("caf\u00e9", "has U+00E9 at character 4")])
def test_a_bad_api_key_from_the_environment_is_named_as_the_environment_s(value, problem):
    """``--api-key`` defaults to ``$CALEXEC_API_KEY``; a key there that no request could
    present (set but empty, as a container's ``CALEXEC_API_KEY: ${KEY}`` with ``KEY`` unset
    gives) was refused as ``calexec serve: --api-key is empty``, naming a flag the command
    never had. The refusal now names the variable (exit 2, one line, nothing started); the
    flag, when given, is still named as the flag and wins over the variable."""
    code = "import sys\nfrom calexec.cli import main\nsys.exit(main(sys.argv[1:]))"
    env = {**os.environ, "CALEXEC_API_KEY": value}
    done = subprocess.run([sys.executable, "-c", code, "serve", "--once"], env=env,
                          capture_output=True, text=True, timeout=120)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0].startswith(f"calexec serve: $CALEXEC_API_KEY {problem}"), lines
    assert value not in lines[0] or not value, lines  # the key itself is never shown
    done = subprocess.run([sys.executable, "-c", code, "serve", "--once", "--api-key", " k"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("calexec serve: --api-key starts or ends with whitespace"), \
        done.stderr


def test_a_batch_of_long_prompts_past_the_default_body_limit_is_served_with_max_body_bytes(
        live):
    """lm-eval sends its context windows as one completions request (``prompt``: a list of
    token-id lists, ``batch_size`` of them): 4 windows of 40,000 ids are ~1.3 MB, over the
    1 MiB body limit, a 413 the server's own ``max_choices`` (16) and context (40,960) would
    otherwise serve, and ``calexec serve`` had no way to raise it (``ServerConfig``'s
    ``max_body_bytes`` only). ``--max-body-bytes`` sets it."""
    ids = [100000 + i % 50000 for i in range(40000)]
    body = json.dumps({"prompt": [ids] * 4, "max_tokens": 1}).encode()
    assert len(body) > 1 << 20
    server, _, _ = live  # the default limit: refused, naming it
    r = httpx.post(f"{server.url}/v1/completions", content=body, timeout=60,
                   headers={"content-type": "application/json"})
    assert r.status_code == 413 and "max_body_bytes=1048576" in r.text, r.text
    port = free_port()
    code = "import sys\nfrom calexec.cli import main\nsys.exit(main(sys.argv[1:]))"
    proc = subprocess.Popen([sys.executable, "-c", code, "serve", "--port", str(port),
                             "--max-body-bytes", "2000000", "--log-level", "warning"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        assert proc.poll() is None, proc.communicate(timeout=10)
        try:
            return httpx.get(f"{url}/ready", timeout=1).status_code == 200
        except httpx.TransportError:
            return False
    try:
        wait_for(up, timeout=60, what="calexec serve to become ready")
        r = httpx.post(f"{url}/v1/completions", content=body, timeout=60,
                       headers={"content-type": "application/json"})
        assert r.status_code == 200, r.text[:500]
        assert len(r.json()["choices"]) == 4 and r.json()["usage"]["prompt_tokens"] == 160000
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)


def test_a_chat_template_that_does_not_compile_is_refused_at_start_naming_it(tmp_path):
    """A ``tokenizer_config.json`` whose ``chat_template`` is no Jinja template (a typo:
    ``{{ m.content }``) was taken at start; every chat request was then a 400 blaming the
    client, ``param: messages``, "messages: the chat template refused them: unexpected
    '}'", for as long as the server ran. It is the server's file: ``calexec serve`` now
    refuses it at start, one line naming ``--tokenizer``, the file and Jinja's reason, exit
    2; a template that compiles is taken as before."""
    templated_tokenizer(tmp_path)
    config = tmp_path / "tokenizer_config.json"
    config.write_text(json.dumps(
        {"chat_template": "{% for m in messages %}{{ m.content }{% endfor %}"}))
    code = "import sys\nfrom calexec.cli import main\nsys.exit(main(sys.argv[1:]))"
    done = subprocess.run([sys.executable, "-c", code, "serve", "--once", "--tokenizer",
                           str(tmp_path)], capture_output=True, text=True, timeout=120)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0].startswith(f"calexec serve: --tokenizer={str(tmp_path)!r}: "
                               f"{str(config)!r}: its chat_template is no Jinja template: "
                               "unexpected '}'"), lines
    from calexec.drivers.serving import hf_tokenizer
    config.write_text(json.dumps(
        {"chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"}))
    assert hf_tokenizer.load(str(tmp_path)).chat_template is not None


def test_a_chat_template_renders_tools_and_loops_as_transformers_does(tmp_path):
    """A chat template is rendered as transformers' ``apply_chat_template`` renders it (vLLM
    does so): Qwen3's and Llama 3.1's templates write each tool with ``tojson``, which was
    Jinja's own filter, sorting the keys and escaping ``<>&'`` and non-ASCII (the model saw
    ``{"description": "a \\u003cb\\u003e caf\\u00e9", "name": ...}`` where transformers
    writes ``{"name": ..., "description": "a <b> café"}``); ``{% break %}`` (the loopcontrols
    extension) and transformers' ``{% generation %}`` block did not compile at all."""
    from calexec.drivers.serving import grammar
    from calexec.drivers.serving.openai_api import ChatMessage, render_chat
    template = ("{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
                "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
                "{% generation %}{{ m.role }}: {{ m.content }}\n{% endgeneration %}{% endfor %}"
                "{{ {'b': 1, 'a': 2} | tojson(indent=1) }}")
    loaded = templated_tokenizer(tmp_path, template)
    tools = grammar.tool_setup([{"type": "function", "function": {
        "name": "f", "description": "a <b> caf\u00e9 & 'q'",
        "parameters": {"type": "object", "properties": {"z": {}, "a": {}}}}}], "none")
    messages = [ChatMessage(role="user", content=c) for c in ("one", "two", "three")]
    text = render_chat(messages, loaded, False, None, False, tools)
    first = text.split("\n")[0]
    assert first.startswith('{"type": "function", "function": {"name": "f", '
                            '"description": "a <b> caf\u00e9 & \'q\'"'), text
    assert '"properties": {"z": {}, "a": {}}' in first, text
    assert "user: one\nuser: two\n" in text and "three" not in text, text
    assert text.endswith('{\n "b": 1,\n "a": 2\n}'), text


def test_a_message_of_several_text_parts_is_rendered_with_a_line_between_them(live):
    """A message whose ``content`` is a list of text parts (LangChain's and llama-index's
    content blocks, the SDK's part lists) had its parts run together ("Part one.Part two.");
    vLLM joins them with a line end for a text model's template, and so does this server
    now: the chat's prompt is the one of the same text given as a string."""
    server, _, _ = live
    parts = [{"type": "text", "text": "Part one."}, {"type": "text", "text": "Part two."}]

    def prompt_ids(content) -> list[int]:
        r = httpx.post(f"{server.url}/v1/chat/completions", timeout=30, json={
            "model": MODEL, "max_tokens": 1, "return_token_ids": True,
            "messages": [{"role": "user", "content": content}]})
        assert r.status_code == 200, r.text
        return r.json()["prompt_token_ids"]

    def counted(content) -> list[int]:
        r = httpx.post(f"{server.url}/tokenize", timeout=30,
                       json={"messages": [{"role": "user", "content": content}]})
        assert r.status_code == 200, r.text
        return r.json()["tokens"]

    assert prompt_ids(parts) == prompt_ids("Part one.\nPart two.") == counted(parts)
    assert prompt_ids([parts[0]]) == prompt_ids("Part one.")  # one part: its text alone


def test_a_chat_template_reads_an_assistant_s_call_arguments_as_their_value(tmp_path):
    """An assistant message's tool calls carry ``arguments`` as JSON text (OpenAI's shape);
    transformers' templates read them as a value, and vLLM parses them before rendering.
    Given the text, Llama 3.1's ``arguments | tojson`` wrote the arguments as one quoted
    string (``"{\\"x\\":1}"``) and Qwen3-Coder's ``arguments | items`` refused every
    multi-turn tool conversation (400 ``messages``). Empty arguments are ``{}``; text that
    is no JSON is kept as given."""
    from calexec.drivers.serving.openai_api import ChatMessage, render_chat
    template = ("{% for m in messages %}{% for c in m.tool_calls or [] %}"
                "{{ c.function.name }}={{ c.function.arguments | tojson }};"
                "{% if c.function.arguments is mapping %}"
                "{% for k, v in c.function.arguments | items %}[{{ k }}:{{ v }}]{% endfor %}"
                "{% endif %}{% endfor %}{% endfor %}")
    loaded = templated_tokenizer(tmp_path, template)

    def call(name: str, arguments: str) -> dict:
        return {"id": name, "type": "function", "function": {"name": name,
                                                              "arguments": arguments}}
    message = ChatMessage(role="assistant", content=None, tool_calls=[
        call("f", '{"x":1,"y":"a"}'), call("g", ""), call("h", "not json")])
    text = render_chat([message], loaded, False)
    assert text == ('f={"x": 1, "y": "a"};[x:1][y:a]g={};h="not json";'), text


def test_a_chat_template_gets_a_message_s_name(tmp_path):
    """OpenAI's messages carry an optional ``name`` (the speaker's); vLLM hands it to the chat
    template, which may write it (``<|im_start|>user name=alice``); it was dropped, so such
    a template wrote every speaker alike. The plain template is unchanged."""
    from calexec.drivers.serving.byte_tokenizer import ByteTokenizer
    from calexec.drivers.serving.openai_api import ChatMessage, render_chat
    template = ("{% for m in messages %}<{{ m.role }}{% if m.name %} name={{ m.name }}{% endif %}>"
                "{{ m.content }}{% endfor %}")
    messages = [ChatMessage(role="user", content="hi", name="alice"),
                ChatMessage(role="user", content="yo")]
    text = render_chat(messages, templated_tokenizer(tmp_path, template), False)
    assert text == "<user name=alice>hi<user>yo", text
    assert render_chat(messages, ByteTokenizer(), False) == "user: hi\nuser: yo\n"


def test_continue_final_message_continues_a_template_that_trims_the_content(tmp_path):
    """``continue_final_message`` cuts the rendered chat right after the final message's
    content; a template that trims it (Llama 3.1's ``message['content'] | trim``) does not
    write a prefix ending in a space (``"Sure, here is "``) as it is, and the request was
    refused (400 ``continue_final_message``) where transformers, and so vLLM, cut after the
    trimmed text. A content the template does not write at all is still refused."""
    from calexec.drivers.serving import hf_tokenizer
    from calexec.drivers.serving.openai_api import ChatMessage, Refusal, render_chat
    template = ("{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}</s>"
                "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
    loaded = templated_tokenizer(tmp_path, template)
    messages = [ChatMessage(role="user", content="hi"),
                ChatMessage(role="assistant", content="Sure, here is ")]
    text = render_chat(messages, loaded, False, None, True)
    assert text == "<user>hi</s><assistant>Sure, here is", text
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": "{% for m in messages %}<{{ m.role }}>{% endfor %}"}))
    with pytest.raises(Refusal):
        render_chat(messages, hf_tokenizer.load(str(tmp_path)), False, None, True)
