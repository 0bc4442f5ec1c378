"""Stop 53's probe of ``calexec serve --native-relay`` and the commands that run it
(docs/traceability.md "Found at stop 53 (relay)"): what the probe found, pinned."""

from __future__ import annotations

import needs

needs.module("httpx", "server")  # the soak drives the server over HTTP ([server])
from calexec.drivers.tools.bench import soak  # noqa: E402


def test_the_readable_soak_report_says_it_ran_on_the_native_relay(capsys):
    """``calexec bench soak --native-relay`` without ``--json`` printed PASS and every
    counter but ``native_relay`` and ``relay_submitted`` (docs/benchmarks.md: "in the
    report"): a run whose submitter never used the relay read the same as one that did."""
    code = soak.run_cli(["bench", "soak", "--requests", "12", "--faults", "0", "--clients",
                         "2", "--decode-us", "2000", "--max-tokens", "3-4", "--progress-s",
                         "600", "--max-seconds", "120", "--rss-bound-mib", "4096",
                         "--native-relay"])
    out = capsys.readouterr().out
    assert code == 0, out
    lines = {line.split(":", 1)[0].strip(): line.split(":", 1)[1].strip()
             for line in out.splitlines()[1:] if ":" in line}
    assert lines.get("native_relay") == "true", out
    assert int(lines.get("relay_submitted", "-1")) >= 1, out
