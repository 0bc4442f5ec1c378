"""``calexec charts mutate``: mutants derived from a declaration, applied before compiling, and
judged by a user's own test command on a user's own chart."""

from __future__ import annotations

import argparse
import json
import sys
import textwrap

import pytest
from statemachine import State, StateMachine
from statemachine.exceptions import TransitionNotAllowed

from calexec.drivers.tools import charts_mutate
from calexec.machines import mutants
from calexec.machines.charts import JobChart
from calexec.machines.compiled import GuardRejected, IllegalTransition, compile_chart
from calexec.machines.paths import GuardTable

DOOR = '''
from statemachine import State, StateMachine


class Door(StateMachine):
    closed = State(initial=True)
    opened = State()
    locked = State()
    gone = State(final=True)

    lock = closed.to(locked, cond="has_key")
    unlock = locked.to(closed, cond="has_key")
    # A strong push opens the door; so does a weak one: the guard decides nothing.
    push = closed.to(opened, cond="strong") | closed.to(opened)
    close = opened.to(closed)
    remove = closed.to(gone) | opened.to(gone)
'''

DOOR_TESTS = '''
import pytest
from door import Door


class Who:
    def __init__(self, key=False, strong=False):
        self.key, self.push_hard = key, strong

    def has_key(self):
        return self.key

    def strong(self):
        return self.push_hard


def state(door):
    (value,) = door.configuration_values
    return value


def test_lock_needs_the_key():
    with pytest.raises(Door.TransitionNotAllowed):
        Door(Who(key=False)).send("lock")
    door = Door(Who(key=True))
    door.send("lock")
    assert state(door) == "locked"


def test_push_opens_and_close_closes():
    door = Door(Who())
    door.send("push")
    assert state(door) == "opened"
    door.send("close")
    assert state(door) == "closed"
'''


@pytest.fixture(autouse=True)
def _forget_door(monkeypatch):
    """The runner imports --chart modules from --cwd: undo that after each test."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield
    sys.modules.pop("door", None)


def _door_project(tmp_path):
    (tmp_path / "door.py").write_text(textwrap.dedent(DOOR))
    (tmp_path / "test_door.py").write_text(textwrap.dedent(DOOR_TESTS))
    return f"{sys.executable} -m pytest -q -p no:cacheprovider test_door.py"


def _mutate(capsys, tmp_path, *args):
    status = charts_mutate.main(["charts", "mutate", "--cwd", str(tmp_path), "--json", *args])
    captured = capsys.readouterr()
    return status, captured


def test_user_chart_killed_and_equivalent_mutants(tmp_path, capsys):
    command = _door_project(tmp_path)
    killable = "guard-true:closed-lock->locked:has_key"  # test_lock_needs_the_key sees it
    equivalent = "guard-false:closed-push->opened:strong"  # the fallback opens the door too
    dropped = "drop:opened-close->closed"
    status, out = _mutate(capsys, tmp_path, "--chart", "door:Door", "--test-cmd", command,
                          "--mutant", killable, "--mutant", equivalent, "--mutant", dropped,
                          "--report", str(tmp_path / "report"))
    assert status == 0, out.err
    report = json.loads(out.out)
    by_id = {m["id"]: m for m in report["mutants"]}
    assert by_id[killable]["status"] == "killed"
    assert by_id[killable]["killed_by"] == ["test_door.py::test_lock_needs_the_key"]
    assert by_id[dropped]["status"] == "killed"
    assert by_id[equivalent]["status"] == "survived"
    door = report["charts"]["Door"]
    assert (door["mutants"], door["killed"], door["survived"], door["error"]) == (3, 2, 1, 0)
    assert door["score"] == pytest.approx(200 / 3)
    markdown = (tmp_path / "report" / "mutation.md").read_text()
    assert f"| Door | `{equivalent}` | survived |" in markdown
    assert json.loads((tmp_path / "report" / "mutation.json").read_text()) == report


def test_documented_equivalent_is_not_a_survivor_and_stale_entries_are_named(tmp_path, capsys):
    command = _door_project(tmp_path)
    killable = "guard-true:closed-lock->locked:has_key"
    equivalent = "guard-false:closed-push->opened:strong"
    (tmp_path / "equivalent.toml").write_text(textwrap.dedent(f"""
        [[mutant]]
        chart = "Door"
        id = "{equivalent}"
        reason = "the guardless fallback opens the door too"

        [[mutant]]
        chart = "Door"
        id = "{killable}"
        reason = "wrongly listed"
    """))
    status, out = _mutate(capsys, tmp_path, "--chart", "door:Door", "--test-cmd", command,
                          "--mutant", killable, "--mutant", equivalent,
                          "--equivalent", "equivalent.toml", "--fail-on-survivor")
    assert status == 0, out.err
    report = json.loads(out.out)
    by_id = {m["id"]: m for m in report["mutants"]}
    assert by_id[equivalent]["status"] == "equivalent"
    assert by_id[equivalent]["reason"] == "the guardless fallback opens the door too"
    assert by_id[killable]["status"] == "killed"
    assert report["stale_equivalents"] == [{"chart": "Door", "id": killable}]
    assert report["charts"]["Door"]["score"] == 100.0
    # the same run without the list: the survivor fails --fail-on-survivor
    status, out = _mutate(capsys, tmp_path, "--chart", "door:Door", "--test-cmd", command,
                          "--mutant", equivalent, "--fail-on-survivor")
    assert status == 1 and json.loads(out.out)["mutants"][0]["status"] == "survived"


def test_mutant_that_never_reaches_the_chart_is_an_error(tmp_path, capsys):
    _door_project(tmp_path)
    status, out = _mutate(capsys, tmp_path, "--chart", "door:Door",
                          "--test-cmd", f"{sys.executable} -c pass",
                          "--mutant", "drop:opened-close->closed")
    assert status == 1
    (mutant,) = json.loads(out.out)["mutants"]
    assert mutant["status"] == "error" and "never applied" in mutant["how"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--chart", "door:Door", "--mutant", "drop:nowhere"], "--test-cmd is required"),
        (["--chart", "door:Door", "--test-cmd", "true", "--mutant", "drop:nowhere"],
         "--mutant='drop:nowhere': no such mutant"),
        (["--chart", "door:Nope", "--test-cmd", "true"],
         "--chart='door:Nope': module 'door' has no attribute 'Nope'"),
        (["--chart", "nosuchmodule:Door", "--test-cmd", "true"], "cannot import module"),
        (["--chart", "door", "--test-cmd", "true"], "--chart='door': expected one of job, kv_txn"),
        (["--chart", "door:Door", "--test-cmd", "false"], "fails without any mutant"),
        (["--chart", "door:Door", "--test-cmd", "true", "--equivalent", "door.py"],
         "--equivalent='"),
        (["--chart", "door:Door", "--test-cmd", "true", "--first-failure"],
         "--first-failure applies to calexec's default command"),
        # found as a newcomer: an empty --test-cmd ran calexec's own default command, a
        # command not found and an unwritable --report (after the whole run) were internal
        # errors (exit 70), a negative --timeout judged every mutant an error
        (["--chart", "door:Door", "--test-cmd", ""], "--test-cmd='': empty command"),
        (["--chart", "door:Door", "--test-cmd", "no-such-test-runner -q"],
         "--test-cmd='no-such-test-runner -q': cannot run 'no-such-test-runner'"),
        (["--chart", "door:Door", "--test-cmd", "true", "--report", "/proc/no/such/dir"],
         "--report='/proc/no/such/dir': cannot make the directory: "),
        (["--chart", "door:Door", "--test-cmd", "true", "--timeout", "-1"],
         "--timeout=-1: must be a number of seconds > 0"),
        (["--chart", "door:Door", "--test-cmd", "true", "--error-codes", "three"],
         "--error-codes='three': expected exit codes"),
        (["--chart", "door:Door", "--test-cmd", "python -c 'pass"],
         "--test-cmd=\"python -c 'pass\": No closing quotation"),
        # 'mutant = 5' (not [[mutant]] tables) was internal error TypeError, exit 70
        (["--chart", "door:Door", "--test-cmd", "true", "--equivalent", "not_tables.toml"],
         "'mutant' must be [[mutant]] tables (chart, id, reason), not int 5"),
        # a newcomer's 'charts mutate door:Door' (as 'charts draw door:Door') was refused as
        # 'unrecognized arguments': a chart given without --chart is taken as one
        (["door:Door", "--test-cmd", "false"], "fails without any mutant"),
        (["door:Nope", "--test-cmd", "true"], "module 'door' has no attribute 'Nope'"),
        # a score is a percentage: --fail-under 150 ran every mutant, then failed whatever
        # they did; -5 and nan passed whatever they did
        (["door:Door", "--test-cmd", "true", "--fail-under", "150"],
         "--fail-under=150: expected a percentage (0-100)"),
        (["door:Door", "--test-cmd", "true", "--fail-under=-5"],
         "--fail-under=-5: expected a percentage (0-100)"),
        (["door:Door", "--test-cmd", "true", "--fail-under", "nan"],
         "--fail-under=nan: expected a percentage (0-100)"),
        # a word was argparse's 'invalid float value', naming no percentage; 1e400 was 'inf'
        (["door:Door", "--test-cmd", "true", "--fail-under", "most"],
         "--fail-under=most: expected a percentage (0-100)"),
        (["door:Door", "--test-cmd", "true", "--fail-under", "1e400"],
         "--fail-under=1e400: expected a percentage (0-100)"),
        # the timeout was echoed converted (0.0, inf), a word was argparse's 'invalid float
        # value': named as given, as --fail-under is
        (["door:Door", "--test-cmd", "true", "--timeout", "0"],
         "--timeout=0: must be a number of seconds > 0 and at most 1e+06"),
        (["door:Door", "--test-cmd", "true", "--timeout", "1e400"],
         "--timeout=1e400: must be a number of seconds > 0 and at most 1e+06"),
        (["door:Door", "--test-cmd", "true", "--timeout", "soon"],
         "--timeout=soon: must be a number of seconds > 0"),
        # a value with a line break broke the one-line refusal in two: quoted
        (["door:Door", "--test-cmd", "true", "--fail-under", "5\n6"],
         "--fail-under='5\\n6': expected a percentage (0-100)\n"),
        (["door:Door", "--test-cmd", "true", "--timeout", "5\n6"],
         "--timeout='5\\n6': must be a number of seconds > 0"),
        # an empty NAME= was taken: every mutant ran, reported under a chart of no name
        # (``|  | ...`` rows, ``"charts": {"": ...}``), stop 63
        (["--chart", "=door:Door", "--test-cmd", "true"],
         "--chart='=door:Door': empty chart name before '='"),
        (["--chart", " =door:Door", "--test-cmd", "true"],
         "--chart=' =door:Door': empty chart name before '='"),
    ],
    ids=["no-test-cmd", "unknown-mutant", "not-a-chart", "no-module", "bad-spec", "red-baseline",
         "bad-equivalent-list", "first-failure-with-own-command", "empty-test-cmd",
         "test-cmd-not-found", "unwritable-report", "negative-timeout", "bad-error-codes",
         "unbalanced-quote", "equivalent-not-tables", "positional-chart",
         "positional-not-a-chart", "fail-under-above-100", "fail-under-negative",
         "fail-under-nan", "fail-under-not-a-number", "fail-under-overflow", "timeout-zero",
         "timeout-overflow", "timeout-not-a-number", "fail-under-two-lines",
         "timeout-two-lines", "empty-chart-name", "blank-chart-name"],
)
def test_bad_arguments_are_named(tmp_path, capsys, args, message):
    _door_project(tmp_path)
    (tmp_path / "not_tables.toml").write_text("mutant = 5\n")
    status, out = _mutate(capsys, tmp_path, *args)
    assert status == 2
    assert message in out.err
    assert "Traceback" not in out.err and out.out == ""


def test_a_selection_of_no_mutant_is_refused_before_the_run(tmp_path, capsys):
    """``--kind guard-true`` on a chart without guards (a newcomer's CI line, copied from
    another chart's) selected nothing, ran the unmutated command anyway and exited 0 with an
    empty report: ``--fail-on-survivor`` passed having judged nothing. It is refused, naming
    the flag and the chart, before anything runs (PIT fails a run that finds no mutation)."""
    (tmp_path / "plain.py").write_text(textwrap.dedent("""
        from statemachine import State, StateMachine


        class Plain(StateMachine):
            a = State(initial=True)
            b = State(final=True)
            go = a.to(b)
    """))
    status, out = _mutate(capsys, tmp_path, "--chart", "plain:Plain", "--test-cmd", "true",
                          "--kind", "guard-true", "--fail-on-survivor")
    assert status == 2, out.err
    assert out.err.splitlines() == [
        "calexec charts mutate: --kind=guard-true: no mutant of Plain is of that kind (a chart "
        "without guards has no guard mutants)"], out.err
    assert out.out == ""
    status, out = _mutate(capsys, tmp_path, "--chart", "plain:Plain", "--test-cmd",
                          f"{sys.executable} -c 'import plain'", "--kind", "drop")
    assert status == 0, out.err  # a kind the chart has: run as before (it survives)
    assert json.loads(out.out)["charts"]["Plain"]["survived"] == 1


def test_a_chart_mutation_cannot_take_is_refused_naming_the_chart_flag(tmp_path, capsys):
    """A newcomer's chart with an invoke (until stop 70 an async action, which mutation takes
    since: its test command runs the chart's instances on python-statemachine's async engine):
    the refusal said ``calexec charts mutate: Aio: chart mutation does not support yet: ...``,
    naming neither ``--chart`` nor the reference given (``charts cover --chart`` names both);
    it reads ``--chart='aio:Aio': ...`` like every other refusal of the flag, before anything
    runs."""
    (tmp_path / "aio.py").write_text(textwrap.dedent("""
        from statemachine import State, StateChart


        class Aio(StateChart):
            idle = State(initial=True, invoke="work")
            done = State(final=True)
            go = idle.to(done)

            def work(self):
                return 1
    """))
    for given in (["--chart", "aio:Aio"], ["aio:Aio"], ["--chart", "Mine=aio:Aio"]):
        status, out = _mutate(capsys, tmp_path, *given, "--test-cmd", "true")
        assert status == 2, out.err
        ref = given[-1]
        lines = out.err.splitlines()
        assert len(lines) == 1, out.err
        assert lines[0].startswith(
            f"calexec charts mutate: --chart={ref!r}: Aio: chart mutation does not support "
            "yet: invoke 'work' on state 'idle' ("), out.err
        assert out.out == ""


@pytest.mark.parametrize("name, content", [
    ("a_directory", None),  # refused by cliargs.read_small_text
    ("bad.toml", "mutant = [\n"),  # the rest by load_equivalents itself
    ("not_tables.toml", "mutant = 5\n"),
    ("no_reason.toml", '[[mutant]]\nchart = "door"\nid = "drop:x"\n'),
])
def test_every_equivalent_list_refusal_names_it_as_flag_equals_value(tmp_path, capsys, name,
                                                                      content):
    """``--equivalent`` errors read ``--equivalent='F': ...`` (a directory, a FIFO: cliargs'
    style) or ``--equivalent 'F': ...`` (bad TOML, no [[mutant]] tables, a field missing): one
    style, cliargs' ``--flag='value'``, for every refusal."""
    _door_project(tmp_path)
    path = tmp_path / name
    if content is None:
        path.mkdir()
    else:
        path.write_text(content)
    status, out = _mutate(capsys, tmp_path, "--chart", "door:Door", "--test-cmd", "true",
                          "--equivalent", name)
    assert status == 2, out.err
    assert out.err.startswith(f"calexec charts mutate: --equivalent={str(path)!r}: "), out.err


def test_a_report_file_that_is_a_directory_is_refused_before_the_run(tmp_path, capsys):
    """``--report DIR`` where ``DIR/mutation.md`` is a directory: the whole run went first,
    then 'internal error: IsADirectoryError', exit 70."""
    command = _door_project(tmp_path)
    (tmp_path / "report" / "mutation.md").mkdir(parents=True)
    status, out = _mutate(capsys, tmp_path, "--chart", "door:Door", "--test-cmd", command,
                          "--report", str(tmp_path / "report"))
    assert status == 2, out.err
    assert out.out == "" and "unmutated run" not in out.err, out.err  # nothing ran
    report = tmp_path / "report"
    assert (f"--report={str(report)!r}: cannot write {str(report / 'mutation.md')!r}: "
            "Is a directory") in out.err, out.err


def test_a_report_that_cannot_be_written_after_the_run_is_one_line_and_the_run_is_kept(
        tmp_path, capsys, monkeypatch):
    """The report directory checked before the run, broken during it: the run's result still
    reaches stdout, then one line naming the file, exit 2 (was a traceback, exit 70)."""
    from calexec import cliargs

    monkeypatch.setattr(cliargs, "writable_file", lambda *args: None, raising=False)
    command = _door_project(tmp_path)
    (tmp_path / "report" / "mutation.json").mkdir(parents=True)
    status, out = _mutate(capsys, tmp_path, "--chart", "door:Door", "--test-cmd", command,
                          "--mutant", "drop:opened-close->closed",
                          "--report", str(tmp_path / "report"))
    assert status == 2, out.err
    assert json.loads(out.out)["mutants"][0]["status"] == "killed"
    last = out.err.strip().splitlines()[-1]
    assert last == (f"calexec charts mutate: --report={str(tmp_path / 'report')!r}: cannot "
                    f"write {str(tmp_path / 'report' / 'mutation.json')!r}: Is a directory"), last


def test_cwd_that_is_not_a_directory_is_named(tmp_path, capsys):
    status, out = _mutate(capsys, tmp_path / "nowhere", "--chart", "job", "--test-cmd", "true")
    assert status == 2
    assert f"--cwd={str(tmp_path / 'nowhere')!r}: not a directory" in out.err


def _light():
    class Light(StateMachine):
        off = State(initial=True)
        on = State()
        burnt = State(final=True)

        switch = off.to(on, cond="powered") | on.to(off)
        fail = on.to(burnt, unless="fused")

    return Light


def test_mutants_are_derived_from_the_declaration():
    ids = [m.id for m in mutants.derive(_light(), targets_per_transition=0)]
    assert ids == [
        "guard-true:off-switch->on:powered", "guard-false:off-switch->on:powered",
        "drop:off-switch->on", "target:off-switch->on:burnt", "target:off-switch->on:off",
        "drop:on-switch->off", "target:on-switch->off:on", "target:on-switch->off:burnt",
        "guard-true:on-fail->burnt:!fused", "guard-false:on-fail->burnt:!fused",
        "drop:on-fail->burnt", "target:on-fail->burnt:off", "target:on-fail->burnt:on",
    ]
    # a bounded selection: the source itself first, then the states declared after the target
    assert [m.id for m in mutants.derive(_light(), 1) if m.kind == "target"] == [
        "target:off-switch->on:off", "target:on-switch->off:on", "target:on-fail->burnt:on"]


@pytest.mark.parametrize(
    ("mutant", "outcomes", "expected"),
    [
        ("guard-true:off-switch->on:powered", {"powered": False}, "on"),
        ("guard-false:off-switch->on:powered", {"powered": True}, GuardRejected),
        ("drop:off-switch->on", {"powered": True}, IllegalTransition),
        ("target:off-switch->on:burnt", {"powered": True}, "burnt"),
    ],
)
def test_compiled_table_follows_the_mutated_declaration(mutant, outcomes, expected):
    light = _light()
    mutants.apply(light, mutant)
    chart = compile_chart(light, "light")
    model = GuardTable.for_chart(chart, outcomes=outcomes, default=False)
    run = chart.run(model)
    machine = light(GuardTable.for_chart(chart, outcomes=outcomes, default=False))
    if isinstance(expected, str):
        assert run.send("switch") == expected
        machine.send("switch")
        assert list(machine.configuration_values) == [expected]
    else:
        with pytest.raises(expected):
            run.send("switch")
        with pytest.raises(TransitionNotAllowed):
            machine.send("switch")
        assert run.state == "off"


def test_unless_guard_keeps_its_sense():
    light = _light()
    mutants.apply(light, "guard-true:on-fail->burnt:!fused")  # fused() forced true: refused
    chart = compile_chart(light, "light")
    with pytest.raises(GuardRejected):
        chart.run(GuardTable.for_chart(chart, default=False), "on").send("fail")


def test_install_from_env_applies_on_import_and_acknowledges(tmp_path, monkeypatch):
    (tmp_path / "lamp_chart.py").write_text(textwrap.dedent(DOOR))
    monkeypatch.syspath_prepend(str(tmp_path))
    ack = tmp_path / "ack"
    value = "lamp_chart:Door@drop:opened-close->closed"
    mutants.install_from_env({mutants.ENV: value, mutants.ACK_ENV: str(ack)})
    try:
        import lamp_chart
    finally:
        sys.modules.pop("lamp_chart", None)
    assert [t.event for t in lamp_chart.Door.opened.transitions] == ["remove"]
    assert ack.read_text() == value + "\n"
    mutants.install_from_env({})  # unset: nothing installed
    assert not any(isinstance(f, mutants.ApplyAfterImport) for f in sys.meta_path)


def test_sample_is_deterministic_and_spread():
    chart = charts_mutate.Chart("job", charts_mutate.CALEXEC_CHARTS["job"], JobChart)
    args = argparse.Namespace(targets_per_transition=2, kind=None, mutant=[], sample=8, seed=0)
    first = charts_mutate.select_mutants([chart], args)
    assert first == charts_mutate.select_mutants([chart], args) and len(first) == 8
    assert {m.kind for _, m in first} == set(mutants.KINDS)


def test_a_mutant_the_tests_import_under_another_module_name_says_so(tmp_path, capsys):
    """``--chart app_door.door:Door`` while the tests import the file as ``door`` (its
    directory on ``sys.path``): every mutant was 'never applied: the command did not import
    the chart', though the tests plainly imported it, under another name (another class, which
    the hook never touches). The reason names the module given and what to do."""
    package = tmp_path / "app_door"
    package.mkdir()
    (package / "door.py").write_text(textwrap.dedent(DOOR))
    script = (f"import sys; sys.path.insert(0, {str(package)!r}); "
              "from door import Door")
    status, out = _mutate(capsys, tmp_path, "--chart", "app_door.door:Door",
                          "--test-cmd", f"{sys.executable} -c \"{script}\"",
                          "--mutant", "drop:opened-close->closed")
    assert status == 1, out.err
    (mutant,) = json.loads(out.out)["mutants"]
    assert mutant["status"] == "error"
    assert mutant["how"] == (
        "mutant never applied: the command did not import the chart (module 'app_door.door'; "
        "a file its tests import under another module name is another class: give --chart as "
        "they import it)"), mutant["how"]


def test_derive_takes_a_compiled_chart_and_refuses_what_is_no_chart_naming_it():
    """Every tool takes the chart class or its ``CompiledChart`` (docs/framework.md, Public
    API), but ``mutants.derive(compiled(Chart))`` raised ``AttributeError: 'str' object has
    no attribute 'parent'``, and ``derive(42)`` or ``apply(42, ...)`` ``'int' object has no
    attribute 'states'`` (found at stop 50 by a library user). ``derive`` takes either and
    names anything else as ``compiled`` does; ``apply``, which mutates the class in place,
    refuses a ``CompiledChart`` (its table would not see the mutation), naming it."""
    from calexec.machines.compiled import compiled

    assert [m.id for m in mutants.derive(compiled(JobChart))] == [
        m.id for m in mutants.derive(JobChart)]
    for bad in (42, "order_workflow:OrderWorkflow", int):
        with pytest.raises(TypeError, match="is not a python-statemachine chart class"):
            mutants.derive(bad)
        with pytest.raises(TypeError, match="is not a python-statemachine chart class"):
            mutants.apply(bad, "x")
    with pytest.raises(TypeError, match=r"pass the chart class itself"):
        mutants.apply(compiled(JobChart), mutants.derive(JobChart)[0].id)


def test_a_named_mutant_outside_the_kind_given_is_refused_before_the_run(tmp_path, capsys):
    """``--kind drop --mutant guard-true:...`` ran the guard-true mutant: ``--mutant``
    replaced the selection and ``--kind`` was dropped without a word, so a CI line meant to
    judge only dropped transitions judged (and could pass on) another kind. Both flags narrow
    the run; a named mutant outside ``--kind`` is refused, naming both, before anything runs."""
    command = _door_project(tmp_path)
    named = "guard-true:closed-lock->locked:has_key"
    status, out = _mutate(capsys, tmp_path, "--chart", "door:Door", "--test-cmd", command,
                          "--kind", "drop", "--mutant", named)
    assert status == 2, out.err
    assert out.err.splitlines() == [
        f"calexec charts mutate: --mutant={named!r}: a guard-true mutant, not of --kind=drop; "
        f"name mutants of that kind, or drop --kind"], out.err
    assert out.out == ""
    status, out = _mutate(capsys, tmp_path, "--chart", "door:Door", "--test-cmd", command,
                          "--kind", "guard-true", "--mutant", named)
    assert status == 0, out.err  # of the kind given: run as before
    assert [(m["id"], m["status"]) for m in json.loads(out.out)["mutants"]] == [(named, "killed")]


def test_examples_with_a_test_command_of_ones_own_is_refused_as_first_failure_is(tmp_path,
                                                                               capsys):
    """``--examples 200`` with ``--test-cmd`` was accepted and changed nothing (it sets
    ``CALEXEC_STATEFUL_EXAMPLES`` for calexec's default command only): a user raising the
    examples of their own hypothesis tests ran the same tests; ``--first-failure`` there is
    refused, and so is ``--examples`` now, naming it, before anything runs."""
    command = _door_project(tmp_path)
    status, out = _mutate(capsys, tmp_path, "--chart", "door:Door", "--test-cmd", command,
                          "--examples", "200")
    assert status == 2, out.err
    assert out.err.splitlines() == [
        "calexec charts mutate: --examples=200 applies to calexec's default command "
        "(CALEXEC_STATEFUL_EXAMPLES of its stateful tests); set your own tests' example count "
        "in --test-cmd"], out.err
    assert out.out == ""


def test_a_chart_the_command_never_imports_stops_running_its_mutants(tmp_path, capsys):
    """The unmutated run never imports ``door`` (the command tests something else): every
    mutant ran the whole command only to be 'never applied' (found at stop 57 by the toolkit
    probe: about 10 s a mutant of a real suite, for a verdict the first one gave). Once one
    mutant of such a chart is not applied, the others are errors without a run, saying why."""
    (tmp_path / "door.py").write_text(textwrap.dedent(DOOR))
    runs = tmp_path / "runs.txt"
    script = f"open({str(runs)!r}, 'a').write('run\\n')"
    ids = ["drop:opened-close->closed", "guard-true:closed-lock->locked:has_key",
           "guard-false:closed-push->opened:strong"]
    status, out = _mutate(capsys, tmp_path, "--chart", "door:Door", "--jobs", "1",
                          "--test-cmd", f"{sys.executable} -c \"{script}\"",
                          *[arg for mutant in ids for arg in ("--mutant", mutant)])
    assert status == 1, out.err
    assert "never imported module 'door'" in out.err, out.err
    mutants_run = json.loads(out.out)["mutants"]
    assert [m["status"] for m in mutants_run] == ["error"] * 3, mutants_run
    assert runs.read_text().splitlines() == ["run"] * 2  # the unmutated run and one mutant
    first, *rest = mutants_run
    assert "not run" not in first["how"], first
    for mutant in rest:
        assert mutant["how"].startswith("mutant never applied: the command did not import "
                                        "the chart"), mutant
        assert mutant["how"].endswith(f"not run: neither the unmutated run nor mutant "
                                      f"{first['id']} imported it"), mutant


def test_a_killer_whose_parametrized_id_holds_a_space_is_named_whole(tmp_path, capsys):
    """Found at stop 59: a mutant killed by ``test_x[call fail]`` (a parametrized id with a
    space, as ``@pytest.mark.parametrize("path", ["call fail"])`` makes) was reported killed
    by ``test_door.py::test_x[call``: the summary line was cut at its first space. The whole
    id is named, up to pytest's `` - <message>``."""
    command = _door_project(tmp_path)
    (tmp_path / "test_door.py").write_text(textwrap.dedent(DOOR_TESTS) + textwrap.dedent('''
        @pytest.mark.parametrize("events", ["push close", "push - close"])
        def test_events_end_closed(events):
            door = Door(Who())
            for event in events.split():
                if event != "-":
                    door.send(event)
            assert state(door) == "closed"
        '''))
    dropped = "drop:opened-close->closed"
    status, out = _mutate(capsys, tmp_path, "--chart", "door:Door", "--test-cmd", command,
                          "--mutant", dropped)
    assert status == 0, out.err
    (mutant,) = json.loads(out.out)["mutants"]
    assert mutant["status"] == "killed", mutant
    assert mutant["killed_by"] == [
        "test_door.py::test_push_opens_and_close_closes",
        "test_door.py::test_events_end_closed[push close]",
        "test_door.py::test_events_end_closed[push - close]"], mutant


def test_every_chart_of_a_module_the_command_never_imports_is_warned_and_stops(tmp_path,
                                                                             capsys):
    """Found at stop 59: of two charts of one module (``door:Door``, ``door:Gate``) that the
    unmutated run never imports, only the last was warned about and stopped after its first
    mutant; the other's mutants each ran the whole command, to be "never applied". Each
    chart of the module is now warned about and stops after one."""
    (tmp_path / "door.py").write_text(textwrap.dedent(DOOR) + textwrap.dedent('''
        class Gate(StateMachine):
            shut = State(initial=True)
            up = State()
            raise_ = shut.to(up)
            lower = up.to(shut)
        '''))
    runs = tmp_path / "runs.txt"
    script = f"open({str(runs)!r}, 'a').write('run\\n')"
    mutants_given = ["Door/drop:opened-close->closed", "Door/drop:closed-push->opened",
                     "Gate/drop:shut-raise_->up", "Gate/drop:up-lower->shut"]
    status, out = _mutate(capsys, tmp_path, "--chart", "door:Door", "--chart", "door:Gate",
                          "--jobs", "1", "--test-cmd", f"{sys.executable} -c \"{script}\"",
                          *[arg for mutant in mutants_given for arg in ("--mutant", mutant)])
    assert status == 1, out.err
    for target in ("door:Door", "door:Gate"):
        assert f"never imported module 'door' (--chart='{target}')" in out.err, out.err
    statuses = [(m["chart"], m["status"], "not run" in m["how"])
                for m in json.loads(out.out)["mutants"]]
    assert statuses == [("Door", "error", False), ("Door", "error", True),
                        ("Gate", "error", False), ("Gate", "error", True)], statuses
    # the unmutated run and one mutant of each chart
    assert runs.read_text().splitlines() == ["run"] * 3
