"""Stop 70's sweep of bad command lines (an operator's view of every command): a flag after
``--``, flags taken and ignored because another flag they act on is absent or switched off,
a ``--max-tokens`` range with no upper end, and help that printed no default when it was 0.

Each refusal is a usage error at parse time: one line naming the flag, exit 2, before any
work (nothing here starts an executor, a server or a benchmark)."""

from __future__ import annotations

import argparse

import pytest

from calexec import cli, cliargs
from calexec.drivers.tools.bench import soak


@pytest.fixture
def no_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """What each command would start once its flags were taken ends the command at once (an
    internal error, exit 70): a flag that is not refused fails the test, never runs a server,
    the gates, a benchmark or a mutation run."""

    def started(*args: object, **kwargs: object) -> None:
        raise AssertionError("the command ran: its flags were taken")

    from calexec import serve
    from calexec.drivers.tools import charts_mutate
    from calexec.drivers.tools.accept import run
    from calexec.drivers.tools.bench import core

    # (serve checks --host before it binds; charts mutate selects its mutants before it runs)
    monkeypatch.setattr(serve, "host_problem", started)
    monkeypatch.setattr(run, "run_accept", started)
    monkeypatch.setattr(core, "run_overhead", started)
    monkeypatch.setattr(core, "run_pingpong", started)
    monkeypatch.setattr(charts_mutate, "select_mutants", started)


def _refused(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    code = cli.main(argv)
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert code == cliargs.EXIT_CONFIG, captured.err
    assert len(lines) == 1, lines  # one line: nothing ran before it
    assert captured.out == ""
    return lines[0]


def test_a_flag_after_double_dash_is_named_as_such_not_as_an_abbreviation(
        capsys: pytest.CaptureFixture[str]):
    """``calexec demo --seqs 2 -- --tokens 1`` (a wrapper that puts ``--`` before the caller's
    flags) said "abbreviations are not taken: did you mean --tokens?" of ``--tokens``, the
    flag spelled in full: the user was sent looking for a typo that was not there. The line
    now says the flag came after ``--`` and where to put it."""
    line = _refused(capsys, ["demo", "--seqs", "2", "--", "--tokens", "1"])
    assert "abbreviation" not in line, line
    assert "--tokens after `--` is an argument, not a flag" in line, line
    assert "put --tokens before `--`" in line, line


def test_an_abbreviation_is_still_named_as_one(capsys: pytest.CaptureFixture[str]):
    """The hint for a real abbreviation (stop 67) is unchanged."""
    line = _refused(capsys, ["demo", "--tok", "1"])
    assert "abbreviations are not taken: did you mean --tokens?" in line, line


@pytest.mark.parametrize(("argv", "flag", "said"), [
    # serve: the dump's flags without the flag that enables the dump (a --dump-prompts meant to
    # record prompts wrote nothing, silently)
    (["serve", "--dump-prompts"], "--dump-prompts", "without --dump-dir"),
    (["serve", "--dump-max-bytes", "5"], "--dump-max-bytes", "without --dump-dir"),
    # the default value given explicitly is given all the same
    (["serve", "--dump-max-bytes", str(16 << 20)], "--dump-max-bytes", "without --dump-dir"),
    # accept: a gate's length for a gate --gates leaves out (no soak ran, nothing said)
    (["accept", "--gates", "correctness", "--soak-seconds", "600"], "--soak-seconds",
     "--gates leaves that gate out"),
    (["accept", "--gates", "soak", "--chaos-seconds", "10"], "--chaos-seconds",
     "--gates leaves that gate out"),
    # bench overhead: the relay floor's settings with the relay floor switched off
    (["bench", "overhead", "--no-relay-floor", "--relay-work-us", "20"], "--relay-work-us",
     "--no-relay-floor"),
    (["bench", "overhead", "--relay-deliver", "caller", "--no-relay-floor"], "--relay-deliver",
     "--no-relay-floor"),
    # charts mutate: the seed of a sample never drawn
    (["charts", "mutate", "--seed", "3"], "--seed", "no --sample is given"),
    # bench pingpong: "seed of the prompts" in its help, and its prompts are fixed
    (["bench", "pingpong", "--seed", "3"], "--seed", "prompts are fixed"),
])
def test_a_flag_that_would_be_ignored_is_refused_naming_what_it_needs(
        capsys: pytest.CaptureFixture[str], no_work: None, argv: list[str], flag: str,
        said: str):
    """Each of these ran with the flag taken and ignored (exit 0, the run's figures not what
    the operator asked for); now a usage error naming the flag and the one it depends on."""
    line = _refused(capsys, argv)
    assert line.startswith(f"calexec {' '.join(argv[:2]) if argv[0] in ('bench', 'charts') else argv[0]}"
                           f": error: argument {flag}: "), line
    assert said in line, line


@pytest.mark.parametrize(("argv", "flag"), [
    # with the flag they depend on, the same flags pass the parse: the run stops at the next
    # flag, refused on its own (so nothing starts)
    (["bench", "overhead", "--relay-work-us", "20", "--relay-deliver", "caller", "--runs", "0"],
     "--runs"),
    (["charts", "mutate", "--seed", "3", "--sample", "2", "--jobs", "0"], "--jobs"),
    (["accept", "--gates", "soak,chaos", "--soak-seconds", "60", "--chaos-seconds", "10",
      "--phase", "c"], "--phase"),
    (["accept", "--soak-seconds", "60", "--chaos-seconds", "10", "--phase", "c"], "--phase"),
    (["serve", "--dump-dir", "d", "--dump-prompts", "--dump-max-bytes", "5", "--port", "-1"],
     "--port"),
])
def test_the_same_flags_with_what_they_act_on_are_taken(
        capsys: pytest.CaptureFixture[str], no_work: None, argv: list[str], flag: str):
    line = _refused(capsys, argv)
    assert f"argument {flag}:" in line, line


def test_only_with_judges_the_flags_given_not_their_defaults():
    """``Parser.only_with``: a flag left at its default is not judged; given (any value) it
    is; a caller's own namespace keeps argparse's rules."""
    p = cliargs.parser("calexec t", None)
    p.add_argument("--on", action="store_true")
    p.add_argument("--level", type=int, default=3)
    # (a string default argparse converts by its type after the command line, as if given)
    p.add_argument("--mode", type=str.upper, default="a")
    for flag in ("--level", "--mode"):
        p.only_with(flag, lambda args: args.on, "needs --on")
    assert vars(p.parse_args([])) == {"on": False, "level": 3, "mode": "A"}
    assert p.parse_args(["--on", "--level", "4", "--mode", "b"]).level == 4
    for argv in (["--level", "3"], ["--mode=a"]):
        with pytest.raises(SystemExit) as ended:
            p.parse_args(argv)
        assert ended.value.code == cliargs.EXIT_CONFIG


@pytest.mark.parametrize("text", ["4-", "-8", "-"])
def test_a_max_tokens_range_without_both_ends_is_refused(text: str):
    """``bench soak --max-tokens 4-`` ran every request at 4 tokens: the dash with nothing
    after it was read as ``4`` alone, not refused as "N or LO-HI"."""
    with pytest.raises(ValueError, match="not N or LO-HI"):
        soak.parse_range(text)
    assert soak.parse_range("4") == (4, 4) and soak.parse_range("4-8") == (4, 8)


@pytest.mark.parametrize(("argv", "flag"), [
    (["demo", "--help"], "--decode-us"),
    (["bench", "overhead", "--help"], "--seed"),
    (["bench", "recovery", "--help"], "--seed"),
    (["bench", "logits", "--help"], "--seed"),
])
def test_help_prints_a_default_of_zero(capsys: pytest.CaptureFixture[str], argv: list[str],
                                       flag: str):
    """Every flag's help shows its default (test_cli.py), but one of 0 was left out: compared
    with ``in (None, False, ...)``, 0 equals False. ``demo --decode-us`` and every ``--seed``
    printed no default."""
    assert cli.main(argv) == 0
    out = " ".join(capsys.readouterr().out.split())
    after = out.split(f" {flag} ", 1)[1]
    assert "(default: 0)" in after.split(" --", 1)[0], after[:300]


def test_default_unshown_tells_zero_from_false():
    assert cliargs.default_unshown(None) and cliargs.default_unshown(False)
    assert cliargs.default_unshown("") and cliargs.default_unshown(argparse.SUPPRESS)
    assert not cliargs.default_unshown(0) and not cliargs.default_unshown(0.0)


def _serve_args(*flags: str) -> tuple[argparse.Namespace, object]:
    from calexec import serve

    args = serve.parser().parse_args(["--ray", *flags])
    return args, cliargs.device_spec(args)


def test_serve_ray_hands_its_replicas_every_flag_of_the_executor():
    """``calexec serve --ray --inflight-capacity 2`` ran every replica in Phase A, and
    ``--allow-unpinned-golden`` did not reach them (a calbin without a pinned golden failed
    every replica's start): ``ReplicaSettings`` had no such fields. Each flag that sets
    ``serve``'s own executor now sets each replica's."""
    from calexec import serve
    from calexec.drivers.serving.server import ServerConfig

    args, spec = _serve_args("--inflight-capacity", "2", "--allow-unpinned-golden",
                             "--native-relay")
    fields = serve.replica_settings(args, ServerConfig(), spec)
    assert fields["inflight_capacity"] == 2
    assert fields["allow_unpinned_golden"] is True and fields["native_relay"] is True
    args, spec = _serve_args()
    fields = serve.replica_settings(args, ServerConfig(), spec)
    assert fields["inflight_capacity"] == 1 and fields["allow_unpinned_golden"] is False


def test_replica_settings_take_the_executor_flags():
    """The [ray] extra's side: ``ReplicaSettings`` takes the fields, checked as the executor's
    own config checks them."""
    import needs

    needs.module("ray", "ray")
    from calexec import serve
    from calexec.drivers.fleet.ray_serve import ReplicaSettings
    from calexec.drivers.serving.server import ServerConfig

    args, spec = _serve_args("--inflight-capacity", "2", "--allow-unpinned-golden")
    settings = ReplicaSettings(**serve.replica_settings(args, ServerConfig(), spec))
    assert settings.inflight_capacity == 2 and settings.allow_unpinned_golden is True
    with pytest.raises(ValueError):
        ReplicaSettings(inflight_capacity=3)


@pytest.mark.parametrize(("argv", "written"), [
    (["demo", "--decode-us", "-1e3"], "write --decode-us=-1e3"),
    (["charts", "mutate", "--chart", "-x"], "write --chart=-x"),
    (["conform", "--lib", "-x"], "write --lib=-x"),
    (["golden", "record", "--calbin", "x", "--note", "-draft"], "write --note=-draft"),
])
def test_a_value_starting_with_a_dash_is_told_how_to_give_it(
        capsys: pytest.CaptureFixture[str], argv: list[str], written: str):
    """``--note -draft`` (an API key, a chart reference, a number argparse does not read as
    negative) was "expected one argument" and no more: the value was given, argparse took it
    for a flag. The line now says how to write it."""
    line = _refused(capsys, argv)
    assert f"expected one argument (a value that starts with '-' is read as a flag: {written})" \
        in line, line


@pytest.mark.parametrize("argv", [["demo", "--seqs"], ["demo", "--seqs", "--tokens", "2"],
                                  ["demo", "--seqs", "--", "-x"]])
def test_a_flag_with_no_value_gets_no_such_hint(capsys: pytest.CaptureFixture[str],
                                                argv: list[str]):
    line = _refused(capsys, argv)
    assert line.endswith("argument --seqs: expected one argument (see calexec demo --help)"), line


def test_the_api_key_is_never_shown_by_the_parser(capsys: pytest.CaptureFixture[str]):
    """``serve --api-key k1 --api-key k2`` (a wrapper's key, then the caller's) wrote both keys
    to stderr in the warning of a flag given twice, a supervisor's log: the server's own checks
    never echo the key. Neither does the parser now, nor its hint for a key starting with
    '-'."""
    assert cli.main(["serve", "--api-key", "sekrit-one", "--api-key", "sekrit-two",
                     "--timeout", "601"]) == cliargs.EXIT_CONFIG
    err = capsys.readouterr().err
    assert "--api-key given twice with different values (not shown: a secret)" in err, err
    line = _refused(capsys, ["serve", "--api-key", "-sekrit-three"])
    assert "write --api-key=VALUE" in line, line
    assert "sekrit" not in err + line


@pytest.mark.parametrize("host", ["127.1", "2130706433", "0x7f000001"])
def test_a_loopback_host_in_another_spelling_is_not_warned_about(
        capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture, host: str):
    """``calexec serve --host 127.1`` (the resolver's spelling of 127.0.0.1) listened on
    loopback and logged "--host='127.1' is not a loopback address and no --api-key is set:
    anyone who reaches it can run completions": the warning judged the flag's text, not the
    address bound. It now judges the listener's address (``--once``: served on 127.0.0.1,
    one sample request, drained)."""
    import logging

    with caplog.at_level(logging.WARNING, logger="calexec.serve"):
        assert cli.main(["serve", "--host", host, "--port", "0", "--once"]) == 0
    assert "serving http://127.0.0.1:" in capsys.readouterr().out
    assert not [r for r in caplog.records if "loopback" in r.getMessage()], caplog.text


def test_a_wildcard_host_is_warned_about_as_the_address_it_binds():
    from calexec import serve

    warned = serve.exposure_warnings("0", None, None, bound="0.0.0.0")
    assert len(warned) == 1 and warned[0].startswith("--host='0' (0.0.0.0) is not a loopback")
    assert serve.exposure_warnings("127.1", None, None, bound="127.0.0.1") == []


def test_a_test_command_given_without_double_dash_is_told_where_it_goes(
        capsys: pytest.CaptureFixture[str]):
    """``calexec charts cover --chart lamp:Lamp python -c 'import lamp'`` (the ``--`` left
    out) was "unrecognized arguments: -c import lamp" and no more; the line now says the
    command goes after ``--``. A typo of one of cover's own flags keeps its "did you mean"."""
    line = _refused(capsys, ["charts", "cover", "--chart", "lamp:Lamp", "python", "-c",
                             "import lamp"])
    assert "unrecognized arguments: -c import lamp (a command with flags of its own goes " \
           "after `--`: calexec charts cover --chart MODULE:CLASS -- COMMAND ...)" in line, line
    line = _refused(capsys, ["charts", "cover", "--chart", "lamp:Lamp", "true", "--mni", "5"])
    assert "(did you mean --min?)" in line and "after `--`" not in line, line


@pytest.mark.parametrize(("text", "said"), [
    ("[[golden\n", ": <toml>: not valid TOML"),
    ('format = 1\n[[golden]]\ncalbin_sha256 = "x"\n', ": golden[0].prompt: missing required key"),
])
def test_a_goldens_file_error_shows_no_none(tmp_path, text: str, said: str):
    """``calexec golden record --out FILE`` of a FILE that is not a goldens file (a calbin
    typed for it) said "FILE: <toml>=None: not valid TOML", and a golden missing a key
    "golden[0].prompt=None: missing required key": the None of no value shown as one. Said
    now as the manifest's errors say it."""
    from calexec.contracts import goldens

    path = tmp_path / "m.goldens.toml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(goldens.GoldenFileError) as refused:
        goldens.load_goldens(path)
    assert str(refused.value).startswith(f"{path}{said}"), str(refused.value)
    assert "None" not in str(refused.value)
