"""Stop 75 (lead): the leftovers of the stop's http probe.

``POST /v1/responses/{id}/cancel`` (the openai SDK's ``responses.cancel``) answered the
stored-response routes' 404, "send the whole conversation in input": advice about a stored
conversation to a user who wanted a running response to stop. OpenAI cancels ``background``
responses only, which this server does not run; a request in progress is an operator's to
cancel (``POST /admin/cancel/{id}``), and the 404 now says so.
"""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai", reason="the SDK tests need the [server] extra")

from test_server_support import sdk_client_fixture  # noqa: E402,F401


def test_a_responses_cancel_names_the_operators_cancel(client) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.cancel("resp_0123")
    body = caught.value.body
    assert isinstance(body, dict)
    assert body["param"] == "response_id"
    assert "POST /admin/cancel/{id}" in body["message"]
    assert "background" in body["message"]
    assert "send the whole conversation" not in body["message"]


def test_the_stored_response_routes_keep_their_advice(client) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.retrieve("resp_0123")
    body = caught.value.body
    assert isinstance(body, dict)
    assert "send the whole conversation in input" in body["message"]


def test_an_unknown_flag_is_offered_only_a_flag_it_is_a_typo_of(capsys) -> None:
    """``calexec charts mutate --out d`` answered "did you mean --timeout?" (difflib's
    default cutoff: ``--out`` shares its letters with ``--timeout``, no more); a typo of a
    flag keeps its suggestion (stop 75's cli probe)."""
    from calexec import cli

    assert cli.main(["charts", "mutate", "--out", "d"]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "unrecognized arguments: --out" in line, line
    assert "--timeout" not in line, line
    assert cli.main(["charts", "mutate", "--timeot", "5"]) == 2
    assert "(did you mean --timeout?)" in capsys.readouterr().err


def test_a_browser_may_send_the_sdks_delete_of_a_response(tmp_path) -> None:
    """With ``--cors-origin``, a browser's preflight of ``DELETE /v1/responses/{id}`` (the JS
    SDK's ``responses.delete``) was refused (400 ``method DELETE is not allowed``), so the
    page saw a network error where the route answers its 404; it is allowed now."""
    import httpx

    from calexec.drivers.serving.server import ServerConfig
    from test_server_support import openai_server

    origin = "http://app.example"
    config = ServerConfig(cors_origins=(origin,))
    with openai_server(tmp_path, config) as (server, _client, _service):
        pre = httpx.options(f"{server.url}/v1/responses/resp_1", timeout=30, headers={
            "origin": origin, "access-control-request-method": "DELETE"})
        assert pre.status_code == 200, pre.text
        assert "DELETE" in pre.headers["access-control-allow-methods"]
        gone = httpx.delete(f"{server.url}/v1/responses/resp_1", timeout=30,
                            headers={"origin": origin})
        assert gone.status_code == 404
        assert gone.headers["access-control-allow-origin"] == origin
