"""Stop 56's docs probe: defects a newcomer met following README.md, docs/framework.md,
docs/server.md, docs/embedding.md and docs/operations.md as written. Real executor on the
bundled emulator, in process (no socket), every wait bounded."""

from __future__ import annotations

from fastapi.testclient import TestClient

from calexec.drivers.serving.server import ServerConfig, create_app
from calexec.drivers.synthetic import calbin as cb
from test_server_support import started_executor

TOKEN = "docs-probe-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def test_a_reload_rolled_back_says_why_the_calbin_was_refused_and_what_to_do(tmp_path):
    """docs/server.md: a reload whose calbin has no pinned golden is refused and rolls back
    (500 ``recovery.rolled_back``). Its message said only ``'m5.calbin' was refused
    (golden.unpinned); ... serves again``, and the log line the same: the operator was not
    told the calbin's sha256 nor to run ``calexec golden record --calbin ...``, which the same
    calbin at ``calexec serve --calbin`` says. The refusal's own message is now in it."""
    unpinned = tmp_path / "m5.calbin"
    sha = cb.write(str(unpinned), cb.default_spec(seed=cb.DEFAULT_SEED ^ 0x3C))
    executor = started_executor(tmp_path)
    try:
        app = create_app(executor, ServerConfig(admin_token=TOKEN))
        with TestClient(app) as client:
            answer = client.post("/admin/reload", json={"calbin": str(unpinned)}, headers=AUTH)
            assert answer.status_code == 500, answer.text
            error = answer.json()["error"]
            assert error["code"] == "recovery.rolled_back" and error["param"] == "calbin"
            message = error["message"]
            assert "golden.unpinned" in message, message
            assert sha in message, message
            assert f"calexec golden record --calbin {unpinned}" in message, message
            assert client.get("/ready").status_code == 200
    finally:
        executor.shutdown(10.0)
