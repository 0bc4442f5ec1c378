"""The conformance report: executor settings derived from the verdicts, Markdown and JSON.

Pure functions over the run's dict (``runner.run`` builds it): nothing here touches the
runtime. A setting is listed as safe only when every verdict it depends on is ``proven``;
otherwise the conservative value is listed with the reason.
"""

from __future__ import annotations

import json
import os
from typing import Any

from calexec.drivers.calrt.verdict import PROVEN

#: the resets a report gives verdicts for (``calexec conform``'s experiments try each)
RESET_KINDS = ("reset_ccu", "reset_configuration", "reset")


def _by_id(questions: list[dict]) -> dict[str, dict]:
    return {q["id"]: q for q in questions}


def _proven(q: dict[str, dict], qid: str) -> bool:
    return qid in q and q[qid]["verdict"] == PROVEN


def safe_settings(questions: list[dict]) -> list[dict[str, str]]:
    """Executor settings and the verdicts that justify them: ``{"setting", "because"}``."""
    q = _by_id(questions)
    out: list[dict[str, str]] = []

    def add(setting: str, because: str) -> None:
        out.append({"setting": setting, "because": because})

    overlap = q.get("overlap.ping_pong", {})
    overlapping = overlap.get("verdict") in ("proven", "disproven") and overlap.get("finding") in ("full", "dma")
    phase_b = (overlapping and _proven(q, "parallel.concurrent_infer_safe") and _proven(q, "slot_reuse.after_wait")
               and _proven(q, "parallel.inflight_depth"))
    if phase_b:
        add("inflight_capacity=2 (Phase B, fixed PING/PONG per slot)",
            f"overlap measured '{overlap['finding']}', concurrent infer, slot reuse after Wait and the in-flight "
            f"depth proven")
    else:
        add("inflight_capacity=1 (Phase A)", "Phase B needs overlap (full or dma), concurrent infer, slot reuse "
            "after Wait and the in-flight depth all proven")
    if _proven(q, "parallel.inflight_depth"):
        add(f"runtime queue depth per engine = {q['parallel.inflight_depth']['finding']}",
            "measured: infer returns 17 beyond it")
    if _proven(q, "slot_reuse.after_wait"):
        add("return a slot's buffers to the pool only after Wait (never after infer)",
            "reuse after Wait proven" + ("" if _proven(q, "slot_reuse.after_infer") else
                                          "; reuse right after infer is not safe"))
    if _proven(q, "slot_reuse.after_undo_slice"):
        add("UndoSlice may run as soon as infer returns", "infer snapshots slices and CSRs (proven)")
    kv = q.get("kv_after_failed_wait", {})
    kv_action = {"unchanged": "resume the sequence from its past_len",
                 "partial": "resume from the device's seq_len (query it), never from the host's count",
                 "committed": "resume from the device's seq_len",
                 "unknown": "release the sequence (rewind to 0) after any failed Wait"}
    if kv.get("verdict") in ("proven", "disproven") and kv.get("finding") in kv_action:
        add(f"kv_after_failed_wait={kv['finding']}: {kv_action[kv['finding']]}", kv["evidence"][:160])
    else:
        add("kv_after_failed_wait=unknown: release the sequence after any failed Wait",
            "not measured: assume the worst")
    kind = reset_kind(questions)
    if kind != "none":
        extra = [] if _proven(q, f"reset.{kind}.keeps_config") else ["configure again"]
        if not _proven(q, f"reset.{kind}.keeps_kv"):
            extra.append("rebuild every sequence's KV")
        add(f"reset_kind={kind}" + (f" (then {', '.join(extra)})" if extra else ""),
            "the weakest reset that aborts both engines' jobs with no stale write and passes the golden")
    else:
        add("reset_kind=none: recover by process restart", "no reset was proven to abort jobs, leave host buffers "
            "untouched and pass the golden (§9.1)")
    timeout = q.get("execution_timeout.reset_recovers", {})
    if timeout.get("verdict") == PROVEN:
        add(f"on execution timeout: hold the buffers, then {timeout['finding']}",
            "no per-job cancel; that reset ended the job and later jobs were correct")
    else:
        add("on execution timeout: hold the buffers and restart the process", "no reset proven to recover")
    return out


def reset_kind(questions: list[dict]) -> str:
    """The executor's ``RecoveryPolicy.reset_kind`` these verdicts justify: the weakest reset
    proven to abort both engines' jobs with no stale write and to pass the golden after it;
    ``"none"`` when no reset was proven (then a fault that needs a reset ends Failed, §9.1)."""
    q = _by_id(questions)
    usable = [k for k in RESET_KINDS
              if all(_proven(q, f"reset.{k}.{a}") for a in ("aborts_jobs", "no_stale_writes", "golden_after"))]
    return usable[0] if usable else "none"


class ReportError(ValueError):
    """A conformance report that cannot be read; the message names the file and the problem."""


def load_run(path: str) -> dict[str, Any]:
    """The run dict of a ``calexec conform --report DIR`` report: ``path`` is that directory or
    its ``conformance.json``. Raises :class:`ReportError`."""
    file = os.path.join(path, "conformance.json") if os.path.isdir(path) else path
    try:
        with open(file, encoding="utf-8-sig") as f:  # (-sig: an editor's leading BOM dropped)
            run = json.load(f)
    except OSError as exc:
        raise ReportError(f"{file!r}: cannot read the conformance report: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise ReportError(f"{file!r}: not a conformance report (invalid JSON: {exc})") from None
    if not isinstance(run, dict) or not isinstance(run.get("questions"), list) or not all(
            isinstance(q, dict) and {"id", "verdict"} <= q.keys() for q in run["questions"]):
        raise ReportError(f"{file!r}: not a conformance report (no 'questions' list of verdicts)")
    run["source"] = file
    return run


def to_json(run: dict[str, Any]) -> str:
    return json.dumps(run, indent=2, sort_keys=False)


def to_markdown(run: dict[str, Any]) -> str:
    lines = [
        "# CalRT conformance report (spec §14)",
        "",
        f"- runtime: `{run['runtime']}` from `{run['library']}`"
        f"{' (bundled emulator, dlopen path)' if run['bundled'] else ''}",
        f"- emulator controls: {'yes' if run['emulator_controls'] else 'no (vendor library)'}; "
        f"device config: `{run['config'] or '(defaults)'}`; sizes: {'quick' if run['quick'] else 'full'}",
        "",
        "## Verdicts",
        "",
        "| question | verdict | finding |",
        "| --- | --- | --- |",
    ]
    lines += [f"| `{q['id']}` | **{q['verdict']}** | {q['finding']} |" for q in run["questions"]]
    lines += ["", "## Executor settings safe to enable", ""]
    lines += [f"- `{s['setting']}` — {s['because']}" for s in run["settings"]]
    lines += ["", "## Evidence", ""]
    for q in run["questions"]:
        lines += [f"### `{q['id']}`: {q['verdict']}", "", f"Claim: {q['claim']}.", "", q["evidence"], "",
                  "```json", json.dumps(q["numbers"], sort_keys=True), "```", ""]
    lines += ["## Experiments", "", "| experiment | outcome | seconds | reason |", "| --- | --- | --- | --- |"]
    lines += [f"| {name} | {e['status']} | {e['seconds']:.2f} | {e['reason']} |"
              for name, e in run["experiments"].items()]
    if run.get("artifacts"):
        lines += ["", "Timing: " + ", ".join(f"`{a}`" for a in run["artifacts"]) + "."]
    return "\n".join(lines) + "\n"
