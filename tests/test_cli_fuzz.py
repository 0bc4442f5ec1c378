"""Bad command lines, generated: every ``calexec`` subcommand (but ``charts ...``, pinned by its
own tests) given a value its flag refuses, a flag without its value, or a mistyped flag.

Each case runs the console script's own entry point, ``calexec.cli.main(argv)``, in process:
every value here is refused while the command line is parsed, before any device opens or
any output is written, so a case takes milliseconds. It must end as a usage error: exit 2,
one line on stderr naming the flag, no traceback, nothing on stdout; never another exception.
"""

from __future__ import annotations

import contextlib
import io
import re
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from calexec import cli, cliargs
from calexec.drivers.serving.process import MAX_SWITCH_INTERVAL_US
from calexec.drivers.serving.service import MAX_CHOICES

# ---- what a flag refuses, by the kind of value it takes ---------------------------------------
_WORDS = st.sampled_from(["x", "", " ", "1.5", "2.0", "1e3", "nan", "inf", "-inf", "0x10",
                          "é中", "a\x01b", "5\n6", "\x1b[31m", "/tmp", "--", "1,2"])


def _not_an_int() -> st.SearchStrategy[str]:
    floats = st.floats(allow_nan=True, allow_infinity=True).map(repr)
    return st.one_of(_WORDS, floats.filter(lambda t: "." in t or "e" in t or "n" in t),
                     st.text(alphabet="abcxyz.,;:!?-+ \t", min_size=1, max_size=6)
                     .filter(lambda t: not t.strip().lstrip("+-").isdigit()))


def _below(low: int) -> st.SearchStrategy[str]:
    return st.one_of(_not_an_int(), st.integers(max_value=low - 1).map(str))


POSITIVE_INT = _below(1)
NON_NEGATIVE_INT = _below(0)
LATENCY_US = st.one_of(_below(0), st.integers(min_value=cliargs.MAX_LATENCY_US + 1).map(str),
                       st.just(str(10 ** 30)))
PORT = st.one_of(_below(0), st.integers(min_value=65536).map(str))
# above the bound too (stop 56: 1e21 us wrapped to 0 in CPython; 1e11 choices exhausted memory)
GIL_US = st.one_of(_below(0), st.integers(min_value=MAX_SWITCH_INTERVAL_US + 1).map(str),
                   st.just(str(10 ** 21)))
CHOICES = st.one_of(_below(1), st.integers(min_value=MAX_CHOICES + 1).map(str),
                    st.just(str(10 ** 11)))
SECONDS = st.one_of(
    st.sampled_from(["x", "", "nan", "inf", "-inf", "0", "-0", "-1", "1e30", str(10 ** 30),
                     "1e8", "soon", "5s"]),
    st.floats(max_value=0.0).map(repr),
    st.floats(min_value=cliargs.MAX_SECONDS, exclude_min=True).map(repr))
CLIENTS = st.one_of(_below(1), st.integers(min_value=cliargs.MAX_CLIENTS + 1).map(str),
                    st.just(str(10 ** 5)))
EMPTY = st.just("")
#: jobs of one sequence: it and the seed token fit the synthetic model's max_seq (sim bench)
SIM_JOBS = st.one_of(_below(1), st.integers(min_value=40960).map(str))
#: a number >= 0 (inf: no bound)
MIB_BOUND = st.one_of(st.sampled_from(["x", "", "nan", "-1", "-inf", "1,5", "5 MiB"]),
                      st.floats(max_value=0.0, exclude_max=True).map(repr))
GATES = st.one_of(st.sampled_from(["", ",", "correctness,,", "nope", "soak,x", " "]),
                  st.text(alphabet="abc,", min_size=1, max_size=8))


#: --inflight-capacity: 1 or 2 only ("2 " is 2, as " 3" is 3 for every integer flag: drawn, it
#: ran a whole `bench faults` and failed the test, now and then, under the dev profile)
INFLIGHT = st.one_of(st.sampled_from(["0", "3", "-1", "x", "", "1.5", "nan", "2x", "1 2"]),
                     st.integers(min_value=3).map(str))


def _count(command_flag: str) -> st.SearchStrategy[str]:
    """A benchmark's count flag (``cliargs.MAX_COUNTS``): below 1, or above its maximum (stop
    73: ``bench logits --iters 99999999999999999999`` ran for ever)."""
    high = cliargs.MAX_COUNTS[command_flag]
    return st.one_of(_below(1), st.integers(min_value=high + 1).map(str),
                     st.just(str(10 ** 20)))


def _choice(choices: tuple[str, ...]) -> st.SearchStrategy[str]:
    return st.one_of(_WORDS, st.text(max_size=6)).filter(lambda t: t not in choices)


# command -> flag -> what it refuses (each validated while parsing)
FLAGS: dict[str, dict[str, st.SearchStrategy[str]]] = {
    "demo": {"--seqs": POSITIVE_INT, "--tokens": POSITIVE_INT, "--prompt-len": POSITIVE_INT,
             "--decode-us": LATENCY_US},
    "serve": {"--port": PORT, "--grace": SECONDS, "--timeout": SECONDS,
              "--max-sequences": POSITIVE_INT, "--max-waiting": NON_NEGATIVE_INT,
              "--max-resumes": NON_NEGATIVE_INT, "--max-body-bytes": POSITIVE_INT, "--max-choices": CHOICES,
              "--dump-max-bytes": POSITIVE_INT, "--gil-switch-us": GIL_US,
              "--tokenizer": EMPTY, "--dump-dir": EMPTY, "--admin-token-file": EMPTY,
              "--metrics-names": _choice(("calexec", "vllm")),
              "--log-level": _choice(("debug", "info", "warning", "error")),
              "--reset-kind": _choice(("reset", "reset_ccu", "reset_configuration", "none")),
              "--inflight-capacity": INFLIGHT},
    "accept": {"--soak-seconds": SECONDS, "--chaos-seconds": SECONDS, "--gates": GATES,
               "--report": EMPTY, "--phase": _choice(("a", "b", "both"))},
    "conform": {"--timeout": SECONDS, "--report": EMPTY,
                "--only": _choice(("parallel", "overlap", "slot_reuse", "exec_timeout",
                                   "kv_failed_wait", "reset"))},
    "diagrams": {"--out": EMPTY, "--png": EMPTY},
    "diagrams live": {"--out": EMPTY, "--seconds": SECONDS, "--clients": CLIENTS},
    "sim write-calbin": {"--tile-d0": POSITIVE_INT, "--hidden": POSITIVE_INT},
    "bench charts": {"--iters": _count("bench charts --iters")},
    "bench overhead": {"--seed": NON_NEGATIVE_INT, "--tokens": POSITIVE_INT,
                       "--runs": _count("bench overhead --runs"), "--zero-tokens": POSITIVE_INT,
                       "--gil-switch-us": GIL_US},
    "bench logits": {"--seed": NON_NEGATIVE_INT, "--iters": _count("bench logits --iters")},
    "bench recovery": {"--seed": NON_NEGATIVE_INT, "--recoveries": _count("bench recovery --recoveries")},
    "bench pingpong": {"--seqs": POSITIVE_INT, "--tokens": POSITIVE_INT,
                       "--solo-tokens": POSITIVE_INT, "--trace": EMPTY},
    "bench server": {"--requests": _count("bench server --requests"), "--max-tokens": POSITIVE_INT,
                     "--decode-us": LATENCY_US, "--rounds": _count("bench server --rounds"),
                     "--loadgen": _choice(("process", "thread")),
                     "--client": _choice(("stdlib", "httpx")), "--gil-switch-us": GIL_US},
    "bench faults": {"--faults": _count("bench faults --faults"), "--clients": CLIENTS,
                     "--inflight-capacity": INFLIGHT},
    "bench soak": {"--requests": _count("bench soak --requests"), "--faults": NON_NEGATIVE_INT,
                   "--clients": CLIENTS, "--max-seconds": SECONDS,
                   "--progress-s": SECONDS, "--rss-bound-mib": MIB_BOUND,
                   "--inflight-capacity": INFLIGHT},
    "golden record": {"--out": EMPTY},
    "sim bench": {"--iters": SIM_JOBS, "--profile-iters": SIM_JOBS},
}
#: what a command needs besides the flag under test to get as far as its flags
REQUIRED = {"golden record": ["--calbin", "x.calbin"], "sim write-calbin": ["out.calbin"]}


def _run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(argv)
    return code, out.getvalue(), err.getvalue()


def _assert_usage_error(argv: list[str], flag: str) -> str:
    code, out, err = _run(argv)
    lines = err.splitlines()
    assert code == cliargs.EXIT_CONFIG, (argv, code, err)
    assert len(lines) == 1, (argv, err)  # one line: no traceback, no progress before it
    assert flag in lines[0], (argv, err)
    assert out == "", (argv, out)
    return lines[0]


@st.composite
def _bad_value(draw: st.DrawFn) -> tuple[list[str], str, str]:
    command = draw(st.sampled_from(sorted(FLAGS)))
    flag = draw(st.sampled_from(sorted(FLAGS[command])))
    value = draw(FLAGS[command][flag])
    joined = draw(st.booleans()) or value.startswith("-")  # (--flag=-1: argparse's own rule)
    words = [f"{flag}={value}"] if joined else [flag, value]
    return [*command.split(), *REQUIRED.get(command, []), *words], flag, value


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_bad_value())
def test_a_refused_value_is_one_line_naming_the_flag_exit_2(case: tuple[list[str], str, str]):
    argv, flag, value = case
    line = _assert_usage_error(argv, flag)
    shown = value.strip()
    if shown and shown.isprintable() and len(shown) < 40:
        assert shown in line or repr(value) in line or repr(value)[1:-1] in line, (argv, line)


@settings(max_examples=80, deadline=None)
@given(st.sampled_from(sorted((c, f) for c in FLAGS for f in FLAGS[c])))
def test_a_flag_without_its_value_is_one_line_naming_it(case: tuple[str, str]):
    command, flag = case
    argv = [*command.split(), *REQUIRED.get(command, []), flag]
    line = _assert_usage_error(argv, flag)
    assert "expected one argument" in line


@settings(max_examples=80, deadline=None)
@given(st.sampled_from(sorted((c, f) for c in FLAGS for f in FLAGS[c])),
       st.sampled_from(["drop", "double", "swap"]))
def test_a_mistyped_flag_is_refused_with_a_suggestion(case: tuple[str, str], typo: str):
    command, flag = case
    name = flag[2:]
    if typo == "drop":
        wrong = "--" + name[:-1]
    elif typo == "double":
        wrong = "--" + name + name[-1]
    else:
        wrong = "--" + (name[1] + name[0] + name[2:] if len(name) > 2 else name + "x")
    known = {f for flags in FLAGS.values() for f in flags}
    if wrong in known:  # (an abbreviation is refused too, since stop 67: tested here)
        return
    argv = [*command.split(), *REQUIRED.get(command, []), wrong, "1"]
    line = _assert_usage_error(argv, wrong.translate({c: None for c in range(32)}))
    assert "did you mean --" in line, line


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(sorted(FLAGS)),
       st.text(alphabet=st.characters(codec="utf-8"), min_size=1, max_size=8))
def test_an_unknown_flag_with_control_characters_stays_one_line(command: str, junk: str):
    # (a word of flag characters alone may be a real flag: `--json`, `--help`)
    assume(not re.fullmatch(r"[a-z0-9-]*", junk))
    word = "--" + junk
    argv = [*command.split(), *REQUIRED.get(command, []), word]
    code, out, err = _run(argv)
    assert code == cliargs.EXIT_CONFIG, (argv, err)
    assert len(err.splitlines()) == 1 and err.endswith("\n"), (argv, err)
    assert "\x1b" not in err and "\r" not in err, err


# ---- the cases the fuzzing found (stop 46), pinned -----------------------------------------
@pytest.mark.parametrize(("argv", "flag", "said"), [
    # a seconds flag took 1e30: serve's drain overflowed a timer at Ctrl-C (exit 70, after a
    # hang), conform's first experiment did (exit 70)
    (["serve", "--grace", "1e30"], "--grace", "at most 1e+06, got '1e30'"),
    (["conform", "--timeout", "1e30"], "--timeout", "at most 1e+06, got '1e30'"),
    (["accept", "--soak-seconds", "1e9"], "--soak-seconds", "at most 1e+06"),
    # above the emulator's range: the device refused to open, exit 3, not naming the flag
    (["demo", "--decode-us", "60000001"], "--decode-us", "must be in 0..60000000 us"),
    (["bench", "server", "--decode-us", "60000001"], "--decode-us", "0..60000000"),
    # an empty output directory wrote the diagrams into the working directory, exit 0
    (["diagrams", "--out", ""], "--out", "empty path"),
    (["diagrams", "--png", ""], "--png", "empty path"),
    (["diagrams", "live", "--out", ""], "--out", "empty path"),
    # an empty item or unknown gate was refused after the parse, not naming --gates
    (["accept", "--gates", "correctness,,"], "--gates", "'' is not a gate"),
    (["accept", "--gates", "nope"], "--gates", "'nope' is not a gate"),
    # `--flag=--`: argparse handed the command an empty list (exit 70, a TypeError)
    (["bench", "charts", "--iters=--"], "--iters", "'--' is not an integer"),
    (["demo", "--seqs=--"], "--seqs", "'--' is not an integer"),
    # a newline or escape in an unknown word was written out raw: two lines, a live escape
    (["demo", "--se\nqs", "1"], "--se\\nqs", "did you mean --seqs?"),
    (["demo", "--x\x1b[2J"], "--x\\x1b[2J", "unrecognized arguments"),
    # (stop 56) argparse's words for a type it called: "invalid _mib_bound value: 'x'" (this
    # module's function name), "invalid int value: '1e3'"
    (["bench", "soak", "--rss-bound-mib", "x"], "--rss-bound-mib", "'x' is not a number"),
    (["bench", "soak", "--rss-bound-mib", "-1"], "--rss-bound-mib", "must be >= 0, got -1"),
    (["sim", "bench", "--iters", "1e3"], "--iters", "'1e3' is not an integer"),
    # (stop 60) serve's two plain `int` flags: "invalid int value: 'x'", argparse's words
    (["serve", "--max-waiting", "x"], "--max-waiting", "'x' is not an integer"),
    (["serve", "--max-resumes", "1.5"], "--max-resumes", "'1.5' is not an integer"),
    (["sim", "bench", "--profile-iters", "40960"], "--profile-iters", "must be in 1..40959"),
])
def test_found_by_fuzzing_is_a_usage_error(argv: list[str], flag: str, said: str):
    line = _assert_usage_error(argv, flag)
    assert said in line, line


# ---- stop 50 -----------------------------------------------------------------------------------
def test_the_longest_seconds_value_fits_the_waits_under_it():
    """`conform --timeout 1e7` (then the largest value taken) was exit 70, `internal error:
    OverflowError: timeout is too large`, at its first experiment, as was `charts mutate
    --timeout 1e7` at its first mutant: a subprocess's wait polls in milliseconds in a C int
    (at most about 24.8 days). The largest value a seconds flag takes must fit it."""
    with subprocess.Popen([sys.executable, "-c", "print('ok')"], stdout=subprocess.PIPE) as proc:
        out, _ = proc.communicate(timeout=cliargs.MAX_SECONDS)
    assert out.strip() == b"ok"
    assert cliargs.seconds(repr(cliargs.MAX_SECONDS)) == cliargs.MAX_SECONDS


@pytest.mark.parametrize("argv", [
    ["conform", "--timeout", "1e7"],
    ["charts", "mutate", "--test-cmd", "true", "--timeout", "1e7"],
])
def test_a_seconds_value_the_waits_cannot_take_is_a_usage_error(argv: list[str]):
    line = _assert_usage_error(argv, argv[-2])
    assert f"at most {cliargs.MAX_SECONDS:g}" in line, line


# ---- stop 61 ---------------------------------------------------------------------------------
@pytest.mark.parametrize(("host", "said"), [
    # a URL's spelling of the address was "not an address or a host name this machine
    # resolves ([Errno -2] Name or service not known)", nothing said of what to write
    ("[::1]", "without the brackets a URL puts around it (--host ::1)"),
    ("[::1]:8000", "(--host ::1 --port 8000)"),
    ("127.0.0.1:8000", "give the port as --port, not in --host (--host 127.0.0.1 --port 8000)"),
    ("http://127.0.0.1", "give the address alone, not a URL"),
])
def test_a_host_written_as_in_a_url_is_refused_saying_how_to_write_it(host: str, said: str):
    line = _assert_usage_error(["serve", "--once", "--host", host], "--host")
    assert said in line, line


@pytest.fixture(scope="module")
def calbin(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("calbin") / "m.calbin")
    assert _run(["sim", "write-calbin", path])[0] == 0
    return path


@pytest.mark.parametrize(("config", "said"), [
    # the emulator takes the last of a key given twice: `golden record` pinned a golden
    # recorded at decode_us=20000 though the string began decode_us=0, exit 0
    ("decode_us=0;kv_blocks=64;decode_us=20000",
     "decode_us given more than once ('decode_us=0', 'decode_us=20000'): give each key once"),
    ("max_seqs=8; max_seqs=8", "max_seqs given more than once"),
    # 1 KiB or more: the emulator's buffer refused it (rc 5); the message blamed the one item
    # that made it long (`decode_us='000...0' refused`), or said "though each item alone opens"
    ("decode_us=" + "0" * 1100, "1110 bytes, refused by the runtime"),
    (";".join(["h2d_us=1", "d2h_us=1"] + [" "] * 600), "1217 bytes, refused by the runtime"),
    # a tab item: the emulator skips only spaces, so it is an item with no '=' (it said
    # "refused ... though each item alone opens")
    ("decode_us=1;\t", "item '\\t' is not key=value"),
    # a blank before '=' is part of the emulator's key (it said `decode_us='5' refused`)
    ("decode_us =5", "'decode_us '='5' refused by the runtime"),
    # bytes of argv that are no UTF-8: the encoder's words, no flag named
    ("decode_us=\udcff", "--device-config='decode_us=\\udcff': not UTF-8 text"),
], ids=["twice", "twice-blank", "long-value", "long-blanks", "tab", "blank-key", "not-utf8"])
def test_a_device_config_the_emulator_would_misread_is_refused_naming_why(
        config: str, said: str, calbin: str, tmp_path):
    out = tmp_path / "g.toml"
    line = _assert_usage_error(["golden", "record", "--calbin", calbin, "--out", str(out),
                                "--device-config", config], "--device-config")
    assert said in line, line
    if len(config) > 1023:
        assert "the bundled emulator reads at most 1023 bytes (a 1 KiB buffer" in line, line
    assert not out.exists()


def test_a_device_config_of_1023_bytes_is_taken(calbin: str, tmp_path):
    config = "decode_us=" + "0" * 1013
    assert len(config) == 1023
    code, _, err = _run(["golden", "record", "--calbin", calbin, "--out",
                         str(tmp_path / "g.toml"), "--device-config", config])
    assert code == 0, err


@pytest.mark.parametrize("config", ["decode_us=1;decode_us=2", "kv_blockz=1"])
def test_serve_ray_names_a_device_config_it_refuses_before_ray_starts(config: str):
    """`serve --ray` handed `--device-config` to its replicas unchecked: a key the runtime
    refuses was each replica's failed deployment (exit 3) after Ray had started, a key given
    twice was served with its last value. Now refused as without --ray (a subprocess: on the
    old code Ray starts)."""
    done = subprocess.run([sys.executable, "-m", "calexec.cli", "serve", "--ray",
                           "--device-config", config], capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == cliargs.EXIT_CONFIG, done.stderr[-2000:]
    assert done.stderr.startswith("calexec serve --ray: --device-config: "), done.stderr[-2000:]
    assert len(done.stderr.splitlines()) == 1, done.stderr[-2000:]
