"""``MODULE:CLASS`` -> the chart class it names: how the commands (``calexec charts draw``,
``charts paths``, ``charts mutate``) and the pytest plugin (``--chart-coverage``) are told
which chart to work on. The module is imported as ``import MODULE`` would from the current
directory (it is put first on ``sys.path``), so a user's own chart needs no installing.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
import inspect
import os
import pkgutil
import re
import signal
import stat
import sys
import threading
from collections.abc import Iterator
from typing import Any

from statemachine import Event, State, StateChart

from calexec.machines.chart_support import named_targets, no_states, reference, same_ids
from calexec.machines.mutants import env_text

#: (module name, thread) for each non-daemon thread a chart module started as ``load_chart``
#: imported it (a scheduler, a heartbeat): ``threads_left_running`` names those still alive
_STARTED_BY_IMPORTS: list[tuple[str, threading.Thread]] = []


def threads_left_running() -> list[tuple[str, threading.Thread]]:
    """(module name, thread) for each non-daemon thread still running that a chart module
    started as ``load_chart`` imported it (a heartbeat, a scheduler started at import): the
    interpreter waits for such a thread as it exits, so a command done with its chart would
    never exit (``calexec charts paths shop:Order`` printed its paths and hung). Empty when
    there is none."""
    return [(name, thread) for name, thread in _STARTED_BY_IMPORTS if thread.is_alive()]


#: a byte of an argument that is not UTF-8, as ``repr`` writes what Python made of it (a lone
#: surrogate U+DC80..U+DCFF, ``surrogateescape``): ``\udcff`` after an even number of
#: backslashes (an odd one is an escaped backslash followed by the text ``udcff``)
_ESCAPED_BYTE = re.compile(r"(?<!\\)((?:\\\\)*)\\udc([89a-f][0-9a-f])")


def bytes_escaped(text: str) -> str:
    """``text`` (a message holding ``repr`` of an argument) with each byte that was not UTF-8
    shown as that byte, ``\\xff``, not as the surrogate Python read it as, ``\\udcff``: the
    user typed (or the file system holds) the byte 0xff, never a U+DCFF."""
    return _ESCAPED_BYTE.sub(r"\1\\x\2", text)


def shown_ref(ref: str) -> str:
    """``repr(ref)`` with its bytes that are not UTF-8 as ``\\xff`` (:func:`bytes_escaped`):
    how a caller naming a reference itself (``--chart=<shown_ref(ref)>: <reason>``) shows it."""
    return bytes_escaped(repr(ref))


class ChartRefError(ValueError):
    """``MODULE:CLASS`` does not name a chart class; the message is one line naming what was
    given and what was expected: ``'<ref>': <reason>``. ``ref`` and ``reason`` are the two
    parts, for a caller that names the reference itself (``--chart=<shown_ref(ref)>:
    <reason>``); a byte of either that is not UTF-8 is shown ``\\xff`` (:func:`bytes_escaped`;
    until stop 73 ``\\udcff``)."""

    def __init__(self, ref: str, reason: str) -> None:
        reason = bytes_escaped(reason)
        super().__init__(f"{shown_ref(ref)}: {reason}")
        self.ref = ref
        self.reason = reason


def load_chart(ref: str, cwd: str | None = None) -> type[StateChart[Any]]:
    """The python-statemachine chart class (a ``StateMachine`` or ``StateChart`` subclass)
    that ``ref`` (``MODULE:CLASS``, ``CLASS`` may be dotted) names; ``cwd`` (default: the
    current directory) goes first on ``sys.path``. Raises ``ChartRefError``; a ``ref`` that is
    no str is a ``TypeError`` naming it."""
    if not isinstance(ref, str):
        kind = ("a chart class already: use it as is, no load_chart" if isinstance(ref, type)
                and issubclass(ref, StateChart) else
                "a path: give the module and class, 'MODULE:CLASS'" if isinstance(ref, os.PathLike)
                else "expected the text 'MODULE:CLASS'")
        raise TypeError(f"load_chart(ref={ref!r:.60}): {kind} (e.g. 'order_workflow:OrderWorkflow')")
    module_name, sep, class_name = ref.partition(":")
    # the class is an attribute, named in UTF-8 source: its name's UTF-8 bytes, whatever the
    # locale decoded the argument as (under LC_ALL=C PYTHONUTF8=0 'pret:Pr\xeat' was
    # "no attribute 'Pr\\udcc3\\udcaat'"); the module names a file, as the file system spells it
    class_name = env_text(class_name)
    if sep:
        ref = f"{module_name}:{class_name}"
    if "\\" in module_name and os.sep != "\\":
        # orders\workflow.py:X, a path as Windows writes it: no module name has a backslash,
        # and the hints below took it for one ("e.g. orders\workflow:X")
        root = os.path.abspath(cwd or os.getcwd())
        posix = module_name.replace("\\", "/")
        dotted = _module_under(root, posix)
        guess = dotted or os.path.splitext(posix)[0].strip("/").replace("/", ".")
        file = posix if posix.endswith(".py") else posix + ".py"
        file = file if file.isprintable() else repr(file)  # (a control character: escaped)
        there = (f"the file {file} is there" if dotted is not None
                 else f"no file {file} is there either")
        # an example only of what import takes: dotted identifiers, an identifier for a class
        example = (f", e.g. {guess}:{class_name if class_name.isidentifier() else 'CLASS'}"
                   if guess and all(part.isidentifier() for part in guess.split("."))
                   else "")
        raise ChartRefError(ref, f"{module_name!r} is a Windows path (a backslash), not a "
                                 f"module name: name the module with dots, as imported from "
                                 f"{root} ({there}), and the class after a colon{example}")
    if not sep or not module_name or not class_name:
        head, _, tail = ref.rpartition(".")
        as_python = not sep and tail.isidentifier() and all(
            part.isidentifier() for part in head.split("."))  # locker.ParcelLocker
        hint = f"; did you mean {head + ':' + tail!r}?" if as_python else ""
        if (as_python or ref.isidentifier()) and _is_module_file(
                os.path.abspath(cwd or os.getcwd()), ref):  # (order_workflow too, undotted)
            # mypkg.charts.orders: a module, not a module and its class
            hint = (f"; {ref!r} is a module: name a chart class it declares after a colon, "
                    f"{ref}:CLASS")
        elif not sep and ("/" in ref or os.sep in ref or ref.endswith(".py")) and os.path.isfile(
                os.path.join(os.path.abspath(cwd or os.getcwd()), ref)):
            # enums.py, src/enums.py: a file, whose ".py" read as a class ('enums:py')
            dotted = _module_under(os.path.abspath(cwd or os.getcwd()), ref)
            stem = os.path.splitext(os.path.basename(ref))[0]
            packaged = _package_module(os.path.join(os.path.abspath(cwd or os.getcwd()), ref))
            if packaged is not None and packaged[0] != os.path.abspath(cwd or os.getcwd()):
                dotted = None
            hint = (f"; {ref!r} is a file path, not a module name: "
                    f"{_in_package(packaged, 'CLASS')}" if dotted is None and packaged is not None
                    else f"; {ref!r} is a file path, not a module name: name its module and a chart "
                    f"class it declares after a colon, {dotted}:CLASS" if dotted is not None
                    else f"; {ref!r} is a file path, not a module name: run from the directory "
                    f"that holds it and name its module and a chart class it declares after a "
                    f"colon, {stem}:CLASS")
        elif not sep and ("/" in ref or os.sep in ref or ref.endswith(".py")):
            # nope.py, src/nope.py: no such file (and no module): its ".py" is no class either
            # (a missing nope.py was answered "did you mean 'nope:py'?")
            root = os.path.abspath(cwd or os.getcwd())
            stem = os.path.splitext(os.path.basename(ref))[0] or ref
            hint = (f"; {ref!r} is no file in {root} (nor a module): name the module that "
                    f"declares the chart, as imported from there, and the class after a "
                    f"colon, e.g. {stem}:CLASS for {stem}.py")
        raise ChartRefError(ref, "expected MODULE:CLASS, a chart class and the module "
                                 "that declares it (e.g. order_workflow:OrderWorkflow)" + hint)
    root = os.path.abspath(cwd or os.getcwd())
    if "/" in module_name or os.sep in module_name or (
            module_name.endswith(".py") and os.path.isfile(os.path.join(root, module_name))):
        directory = os.path.join(root, module_name)
        if os.path.isdir(directory):  # shop/:Order (a package tab-completed by the shell)
            raise ChartRefError(ref, f"{module_name!r} is a directory, not a module name: "
                                f"{_directory_hint(root, directory, class_name)}")
        packaged = _package_module(directory)
        if packaged is not None and packaged[0] != root:
            # (acme/charts/door.py, a module of package acme.charts: the file's own name,
            # door:Door, fails on its relative imports, w.acme.charts.door:Door is another
            # module than the tests' acme.charts.door)
            raise ChartRefError(ref, f"{module_name!r} is a file path, not a module name: "
                                f"{_in_package(packaged, class_name)}")
        dotted = _module_under(root, module_name)
        if dotted is not None and "." in dotted:
            raise ChartRefError(ref, f"{module_name!r} is a file path, not a module name: "
                                f"name the module, as imported from {root} (e.g. "
                                f"{dotted}:{class_name})")
        if dotted is not None:  # (doors.py:Door, run where doors.py is, was told to run there)
            raise ChartRefError(ref, f"{module_name!r} is a file path, not a module name: "
                                f"name the module, without "
                                f"{'.py' if module_name == dotted + '.py' else 'the path and .py'}"
                                f": {dotted}:{class_name} (imported from {root}, where the "
                                f"file is)")
        stem = os.path.splitext(os.path.basename(module_name))[0] or module_name
        if not os.path.exists(os.path.join(root, module_name)) and not os.path.exists(
                os.path.join(root, module_name + ".py")):
            # src/nope.py:Door, no such file: "run from the directory that holds it"
            raise ChartRefError(ref, f"{module_name!r} is no file in {root} (nor a module "
                                f"name): name the module that declares the chart, as "
                                f"imported from there, without a path and .py (e.g. "
                                f"{stem}:{class_name} for {stem}.py)")
        full = os.path.normpath(os.path.join(root, module_name))
        if os.path.dirname(full) == root:  # (my-charts.py:Door, run where it is: was told
            # to run from the directory that holds it)
            raise ChartRefError(ref, f"{module_name!r} is a file path, not a module name: "
                                f"name the module, without .py: {stem}:{class_name} (imported "
                                f"from {root}, where the file is)")
        raise ChartRefError(ref, f"{module_name!r} is a file path, not a module name: run "
                            f"from the directory that holds it and name the module "
                            f"(e.g. {stem}:{class_name})")
    if module_name.endswith(".py") and not _is_module_file(root, module_name):
        # nope.py:Door with no nope.py there: "No module named 'nope'" named neither
        stem = os.path.splitext(os.path.basename(module_name))[0] or module_name
        raise ChartRefError(ref, f"{module_name!r} is no file in {root} (nor a module): name "
                            f"the module that declares the chart, as imported from there, "
                            f"without .py (e.g. {stem}:{class_name} for {stem}.py)")
    if root not in sys.path:
        sys.path.insert(0, root)
    with _interrupts() as interrupted:
        try:
            already = set(threading.enumerate())
            try:
                module = importlib.import_module(module_name)
            finally:  # (a thread a module starts as it is imported keeps a command from exiting)
                _STARTED_BY_IMPORTS.extend(
                    (module_name, thread) for thread in threading.enumerate()
                    if thread not in already and not thread.daemon)
        except KeyboardInterrupt as err:
            if interrupted is None or interrupted:  # Ctrl-C (or not known not to be): stop
                raise
            # the module raised it itself: it is a module that cannot be imported
            raise ChartRefError(ref, f"cannot import module {module_name!r} from {root} "
                                f"(KeyboardInterrupt{_where(err, root)}: raised by the "
                                f"module as it was imported, no Ctrl-C)") from err
        except BaseException as err:  # noqa: BLE001 - the user's module may raise anything at
            # import, sys.exit() and an argparse error (SystemExit) included
            # (a bare `sys.exit()` or `raise ValueError()` has no text: the line ended in ": )")
            why = _first_line(str(err)) or (
                "sys.exit() with no code" if isinstance(err, SystemExit) else "no message")
            hint = ""
            if isinstance(err, ModuleNotFoundError) and err.name == module_name.split(".")[0]:
                hint = _found_below(root, module_name) or _found_above(root, module_name)
            hint += _same_ids_hint(err) + _package_hint(err, root, module_name, class_name)
            if (not hint and isinstance(err, ModuleNotFoundError) and err.name
                    and module_name.startswith(err.name)):
                hint = _near_module(root, err.name)
            raise ChartRefError(ref, f"cannot import module {module_name!r} from {root} "
                                f"({type(err).__name__}{_where(err, root)}: {why}){hint}"
                                ) from err
    found: object = module
    owner: object = module  # what the last part is read from
    missing = object()
    for part in class_name.split("."):
        owner = found
        try:
            found = getattr(found, part, missing)
        except Exception as err:  # noqa: BLE001 - a module's __getattr__, a property
            raise ChartRefError(ref, f"reading {class_name!r} of module {module_name!r} "
                                f"raised {type(err).__name__}: {_first_line(str(err))}") from err
        if found is missing:
            _refuse_shadowed(ref, root, module_name, module)
            raise ChartRefError(ref, f"module {module_name!r} has no attribute "
                                f"{class_name!r} (expected a chart class there)"
                                f"{_class_name_of(owner, module_name, part)}"
                                f"{_unbound_hint(module, owner, root, part)}")
    if not (isinstance(found, type) and issubclass(found, StateChart)):
        _refuse_shadowed(ref, root, module_name, module)
        if inspect.isfunction(found):  # (a chart factory, say: its repr is an address)
            raise ChartRefError(ref, f"{class_name} is a function, not a python-statemachine "
                                f"chart class (a StateMachine or StateChart subclass): a chart "
                                f"a function makes is named by the name its module binds it "
                                f"to (Chart = {class_name}(...), then {module_name}:Chart)"
                                f"{_near_chart(owner, '') or _no_chart(module)}")
        raise ChartRefError(ref, f"{class_name} is {type(found).__name__} {_shown(found)}, "
                            f"not a python-statemachine chart class (a StateMachine or "
                            f"StateChart subclass)"
                            f"{_not_chart_hint(owner, found, module, module_name, class_name)}")
    if not found.states:
        raise ChartRefError(ref, no_states(found, _reference))
    return found


def _reference(declaration: type) -> str:
    """``module:Class``, the reference a command takes for ``declaration``."""
    return reference(declaration)


#: control characters (C0, DEL, C1) shown escaped in a message: a module's own error text may
#: hold an escape sequence, which must not reach the terminal live
_CONTROL = {c: repr(chr(c))[1:-1] for c in (*range(0x20), *range(0x7f, 0xa0))}


def _first_line(text: str) -> str:
    """The first line of ``text``, its control characters escaped."""
    return (text.splitlines()[0] if text else "").translate(_CONTROL)


def _shown(value: object, limit: int = 60) -> str:
    """``repr(value)`` for a one-line message: its first line, at most ``limit`` characters
    (cut with ``...``), the repr of the type when the object's own ``__repr__`` raises."""
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - a user's object: its __repr__ may raise anything
        text = object.__repr__(value)
    text = _first_line(text)
    return text if len(text) <= limit else text[:limit - 3] + "..."


@contextlib.contextmanager
def _interrupts() -> Iterator[list[int] | None]:
    """While a user's module is imported: the SIGINTs (Ctrl-C) that arrived, so that a
    ``KeyboardInterrupt`` the module raises itself is told from the user's Ctrl-C (which
    still interrupts). Always empty when SIGINT is ignored (a job started in the background:
    no Ctrl-C can arrive). None when that cannot be known (not the main thread, or another
    SIGINT handler): every ``KeyboardInterrupt`` is then taken for a Ctrl-C."""
    if threading.current_thread() is not threading.main_thread():
        yield None
        return
    handler = signal.getsignal(signal.SIGINT)
    if handler is signal.SIG_IGN:
        yield []
        return
    if handler is not signal.default_int_handler:
        yield None
        return
    seen: list[int] = []

    def interrupt(signum: int, _frame: object) -> None:
        seen.append(signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, interrupt)
    try:
        yield seen
    finally:
        if signal.getsignal(signal.SIGINT) is interrupt:  # (a handler the module set stays)
            signal.signal(signal.SIGINT, signal.default_int_handler)


def _made(err: BaseException) -> type[StateChart[Any]] | None:
    """The chart class python-statemachine was creating when ``err`` was raised (its
    metaclass's ``cls``; the innermost), or None."""
    made = None
    tb = err.__traceback__
    while tb is not None:
        found = tb.tb_frame.f_locals.get("cls") if tb.tb_frame.f_code.co_name == "__init__" else None
        if isinstance(found, type) and issubclass(found, StateChart):
            made = found
        tb = tb.tb_next
    return made


def _same_ids_hint(err: BaseException) -> str:
    """``; its cause may be: 2 states with id 'idle' (in 'p', 'q'), ...`` when the chart
    class python-statemachine refused as it was made declares one state id twice: it keeps
    one of them, and its refusal names what follows from that (``unreachable states ...
    ['done']``), not the cause. "" otherwise."""
    made = _made(err)
    if made is None:
        return ""
    try:
        same = same_ids(made)
    except Exception:  # noqa: BLE001 - a class half made: no hint rather than another error
        return ""
    if same:
        return (f"; its cause may be: {'; '.join(same)}, of which python-statemachine keeps "
                f"one: rename one")
    try:
        named = named_targets(made)
    except Exception:  # noqa: BLE001 - as above
        return ""
    return f"; its cause may be: {'; '.join(named)}" if named else ""


def _where(err: BaseException, root: str) -> str:
    """`` in chart class Broken at bad_chart.py:7`` for an error raised while a module under
    ``root`` was imported: the chart class python-statemachine was creating when it refused
    the definition (its metaclass's ``cls``), and the last line of a file under ``root`` the
    error passed through; ``""`` when neither is known. The chart's own message names the
    problem, not the class: a module of several charts would leave the reader guessing."""
    made = _made(err)
    chart = made.__qualname__ if made is not None else ""
    line = ""
    tb = err.__traceback__
    while tb is not None:
        filename = tb.tb_frame.f_code.co_filename  # "<frozen importlib...>": no file
        if os.path.isabs(filename) and filename.startswith(root + os.sep):
            line = f"{os.path.relpath(filename, root)}:{tb.tb_lineno}"
        tb = tb.tb_next
    return (f" in chart class {chart}" if chart else "") + (f" at {line}" if line else "")


#: directories ``_found_below`` does not look into: none holds a project's own modules
_NOT_SEARCHED = {"node_modules", "site-packages", "__pycache__", "build", "dist"}


def _found_below(root: str, module_name: str, depth: int = 3, budget: int = 2000) -> str:
    """``; src/kettle.py is there: ...`` naming the directories below ``root`` (at most
    ``depth`` deep, ``budget`` directories looked at) from which ``module_name`` would be
    imported, and how to put one on the path; "" when there is none. A project whose tests put
    ``src`` on ``sys.path`` themselves imports ``kettle`` fine, while ``kettle:Kettle``, imported
    before any test runs, was refused naming only the missing module."""
    parts = module_name.split(".")
    found: list[str] = []
    level = [root]
    for _ in range(depth):
        below: list[str] = []
        for directory in level:
            try:
                entries = sorted(os.scandir(directory), key=lambda entry: entry.name)
            except OSError:
                continue
            for entry in entries:
                if (budget <= 0 or entry.name.startswith(".") or entry.name in _NOT_SEARCHED
                        or not entry.is_dir(follow_symlinks=False)):
                    continue
                budget -= 1
                if os.path.isfile(os.path.join(entry.path, "pyvenv.cfg")):
                    continue  # a virtual environment
                module = os.path.join(entry.path, *parts)
                if os.path.isfile(module + ".py") or os.path.isfile(
                        os.path.join(module, "__init__.py")):
                    found.append(os.path.relpath(entry.path, root))
                below.append(entry.path)
        level = below
    if not found:
        return ""
    first = found[0]
    shown = os.path.join(first, *parts) + (
        ".py" if os.path.isfile(os.path.join(root, first, *parts) + ".py") else "")
    more = f" (and below {', '.join(found[1:3])})" if len(found) > 1 else ""
    return (f"; {shown} is there{more}: put {first} on the path as the command starts "
            f"(PYTHONPATH={first}; in pytest's configuration, pythonpath = {first})")


def _is_chart(value: object) -> bool:
    return isinstance(value, type) and issubclass(value, StateChart) and bool(value.states)


def _class_name_of(owner: object, module_name: str, name: str) -> str:
    """``; 'Pipeline' is the class name of stages:Feature, stages:Hotfix ...`` when ``owner``
    binds charts whose class is called ``name`` under other names (charts a factory made:
    their diagrams, coverage lines and live page show the class name), "" otherwise."""
    try:
        bound = sorted(key for key, value in vars(owner).items()
                       if isinstance(key, str) and _is_chart(value) and value.__name__ == name)
    except TypeError:  # an object without __dict__
        return ""
    if not bound:
        return ""
    return (f"; {name!r} is the class name of "
            f"{', '.join(f'{module_name}:{key}' for key in bound[:8])} (charts bound under "
            f"other names, as a factory's are): name {'it' if len(bound) == 1 else 'one'} so")


def _near_chart(owner: object, name: str) -> str:
    """``; did you mean 'ParcelLocker'?`` naming the chart class of ``owner`` (a module, or a
    class holding charts) nearest ``name``, or its chart classes when none is near
    (``; its chart classes: A, B``), "" when it holds none: ``locker:Parcellocker`` (a case
    slip) or ``locker:Parcel`` (the model) said only that the name is missing or no chart."""
    try:
        charts = sorted(key for key, value in vars(owner).items()
                        if isinstance(key, str) and _is_chart(value))
    except TypeError:  # an object without __dict__
        return ""
    if not charts:
        return ""
    near = _near(name, charts) if name else None
    if near is not None:
        return f"; did you mean {near!r}?"
    return f"; its chart classes: {', '.join(charts[:8])}{', ...' if len(charts) > 8 else ''}"


def _no_chart(module: object) -> str:
    """``; module 'm' declares no chart class`` when ``module`` holds none (a chart module
    mixed up with the model's), "" otherwise."""
    try:
        held = list(vars(module).values())
    except TypeError:
        return ""
    if any(_is_chart(value) for value in held):
        return ""
    return f"; module {getattr(module, '__name__', '?')!r} declares no chart class"


#: how many files of a package ``_declaring`` reads, at most (a chart's class statement is
#: looked for as text: importing every module of a package to find it could run anything)
_SCAN_FILES = 200
#: how many directories ``_declaring`` lists, at most (``./:Order`` from a home directory)
_SCAN_DIRS = 1000


def _declaring(directory: str, class_name: str) -> str | None:
    """The path of the ``.py`` file under ``directory`` (its subdirectories too, at most
    ``_SCAN_FILES`` files read in ``_SCAN_DIRS`` directories listed) whose text declares
    ``class_name`` (``class OrderFlow(`` or ``OrderFlow = ...`` at the start of a line), or
    None. Only regular files are read, each opened without waiting (a FIFO named ``a.py``
    held the search in its open for ever, and the walk went on through every directory
    once the files' bound was reached, until stop 71)."""
    if not class_name.isidentifier():
        return None
    pattern = re.compile(rf"^(class\s+{class_name}\b|{class_name}\s*=)", re.MULTILINE)
    read = 0
    for listed, (here, dirs, files) in enumerate(os.walk(directory)):
        if listed >= _SCAN_DIRS:
            return None
        dirs[:] = sorted(d for d in dirs if d.isidentifier())
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            if read >= _SCAN_FILES:
                return None
            path = os.path.join(here, name)
            if _declares(path, pattern):
                return path
            read += 1
    return None


def _declares(path: str, pattern: re.Pattern[str]) -> bool:
    """Whether the regular file ``path``'s first megabyte matches ``pattern`` (anything else,
    or a file that cannot be read: False, without waiting)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        with os.fdopen(fd, encoding="utf-8", errors="replace", closefd=False) as source:
            return pattern.search(source.read(1_000_000)) is not None
    except OSError:
        return False
    finally:
        os.close(fd)


def _directory_hint(root: str, directory: str, class_name: str) -> str:
    """What to name for ``directory`` given as a module (``shop/:OrderFlow``): the module under
    it that declares ``class_name``, else the directory's own module name."""
    path = _declaring(directory, class_name)
    dotted = _module_under(root, path) if path is not None else None
    if path is not None and dotted is not None:
        return (f"{class_name} is declared in {os.path.relpath(path, root)}: name "
                f"{dotted.removesuffix('.__init__')}:{class_name}")
    parts = os.path.relpath(os.path.normpath(directory), root).split(os.sep)
    if all(part.isidentifier() for part in parts):
        return f"name the module, as imported from {root} (e.g. {'.'.join(parts)}:{class_name})"
    return f"run from the directory that holds the chart's module and name it (MODULE:{class_name})"


def _not_chart_hint(owner: object, found: object, module: object, module_name: str,
                    class_name: str) -> str:
    """The end of the line refusing ``found``, no chart class: the chart it is part of, a
    chart class of ``owner``, or that the module declares none."""
    return (_part_of(owner, found, module_name, class_name) or _near_chart(owner, "")
            or _no_chart(module))


def _part_of(owner: object, found: object, module_name: str, class_name: str) -> str:
    """``; it is a state of chart OrderFlow: the tools take a whole chart, shop:OrderFlow``
    when ``found`` (named ``Chart.part`` or deeper) is a state or event of a chart class
    (a compound state a newcomer means to draw alone), "" otherwise."""
    if not isinstance(found, (State, Event)) or "." not in class_name:
        return ""
    parts = class_name.split(".")
    chart: object = sys.modules.get(module_name)
    chart_path: list[str] = []
    for part in parts[:-1]:
        chart = getattr(chart, part, None)
        chart_path.append(part)
        if _is_chart(chart):
            break
    else:
        return ""
    kind = "state" if isinstance(found, State) else "event"
    name = ".".join(chart_path)
    return (f"; it is {'a' if kind == 'state' else 'an'} {kind} of chart {name}: the tools "
            f"take a whole chart, {module_name}:{name}")


def _unbound_hint(module: object, owner: object, root: str, name: str) -> str:
    """The end of the line refusing a ``name`` its ``owner`` (the module, or a class of it)
    does not bind: the submodule declaring it, a chart class near it, or that the module
    declares none."""
    return ((_in_submodule(module, root, name) if owner is module else "")
            or _near_chart(owner, name) or _no_chart(module))


def _in_submodule(module: object, root: str, class_name: str) -> str:
    """``; OrderFlow is declared in shop/workflow.py: name shop.workflow:OrderFlow`` when
    ``module`` is a package whose own module does not bind ``class_name`` but a module under
    it declares it (the package's ``__init__`` imports nothing), "" otherwise."""
    paths = getattr(module, "__path__", None)
    if not paths:
        return ""
    for directory in list(paths)[:4]:
        path = _declaring(str(directory), class_name)
        if path is None or os.path.basename(path) == "__init__.py" and (
                os.path.dirname(path) == str(directory)):
            continue
        dotted = _module_under(root, path)
        if dotted is None:
            return f"; {class_name} is declared in {path}: name its module"
        return (f"; {class_name} is declared in {os.path.relpath(path, root)}: name "
                f"{dotted.removesuffix('.__init__')}:{class_name}")
    return ""


def _near(name: str, names: list[str]) -> str | None:
    """The one of ``names`` ``name`` most likely mistypes (the same but for case first), or
    None."""
    same = [candidate for candidate in names if candidate.lower() == name.lower()]
    if same:
        return same[0]
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.75)
    return close[0] if close else None


def _near_module(root: str, missing: str) -> str:
    """``; did you mean 'locker'?`` naming the module nearest ``missing`` (a dotted name
    ``import`` did not find) beside where it was looked for: ``root`` for a top-level one
    (not the rest of ``sys.path``: a stdlib name is no chart's), the parent package for a
    submodule; "" when none is near."""
    parent, _, leaf = missing.rpartition(".")
    if parent:
        package = sys.modules.get(parent)
        where = list(getattr(package, "__path__", None) or [])
    else:
        where = [root]
    try:
        names = sorted({module.name for module in pkgutil.iter_modules(where)})
    except OSError:
        return ""
    if leaf in names:
        # (pkgutil lists a directory named ``door.py`` as module ``door``, which import does
        # not find: "No module named 'door'; did you mean 'door'?" until stop 74)
        shown = next((os.path.join(place, leaf + ".py") for place in where
                      if os.path.isdir(os.path.join(place, leaf + ".py"))), None)
        return (f"; {os.path.relpath(shown, root)} there is a directory, not a module file"
                if shown is not None else "")
    near = _near(leaf, names)
    if near is None:
        return ""
    return f"; did you mean {(parent + '.' if parent else '') + near!r}?"


def _package_hint(err: BaseException, root: str, module_name: str, class_name: str) -> str:
    """``; ticket is module pkg.charts.ticket of a package: run from /src and name
    pkg.charts.ticket:Ticket`` when the module's relative imports failed because it was
    imported from inside its package (its directory holds an ``__init__.py``); "" otherwise."""
    if not (isinstance(err, ImportError) and "relative import" in str(err)):
        return ""
    directory, parts = os.path.join(root, *module_name.split(".")[:-1]), [module_name]
    while os.path.isfile(os.path.join(directory, "__init__.py")):
        directory, package = os.path.split(directory)
        if not package.isidentifier():
            return ""
        parts.insert(0, package)
    if len(parts) == 1:
        return ""
    dotted = ".".join(parts)
    return (f"; {module_name} is module {dotted} of a package: run from {directory} and name "
            f"{dotted}:{class_name}")


def _refuse_shadowed(ref: str, root: str, module_name: str, module: object) -> None:
    """Refuse ``ref`` when ``module_name`` names a module file under ``root`` but the module
    imported is another file: one of that name imported already (python's ``queue``,
    ``tokenize``, a module calexec or a plugin imported first), which ``import`` returns
    before looking at ``root``. ``queue:Q`` with the chart in ./queue.py was answered
    ``module 'queue' has no attribute 'Q' ...; module 'queue' declares no chart class``."""
    base = os.path.join(root, *module_name.split("."))
    mine = next((path for path in (base + ".py", os.path.join(base, "__init__.py"))
                 if os.path.isfile(path)), None)
    imported = getattr(module, "__file__", None)
    if mine is None or (isinstance(imported, str)
                        and os.path.realpath(imported) == os.path.realpath(mine)):
        return
    where = imported if isinstance(imported, str) else "built into python"
    top = module_name.split(".")[0]
    yours = os.path.relpath(mine, root)
    raise ChartRefError(ref, f"module {module_name!r} is not {yours} but another module of "
                        f"that name imported already ({where}), which import returns: "
                        f"{yours} is never read; rename your {top!r} (e.g. {top}_chart, "
                        f"then {top}_chart{module_name[len(top):]}:{ref.partition(':')[2]})")


def _package_module(path: str) -> tuple[str, str] | None:
    """``(directory, dotted)`` for a module file ``path`` (``.py`` optional) whose directory is
    a package (holds an ``__init__.py``): the directory holding its top package, from which
    ``import dotted`` finds it, and its dotted name; None for a file of no package, or a
    package part that is no identifier."""
    full = os.path.normpath(path if path.endswith(".py") else path + ".py")
    directory, name = os.path.split(full)
    stem = name[:-len(".py")]
    if not (os.path.isfile(full) and stem.isidentifier()
            and os.path.isfile(os.path.join(directory, "__init__.py"))):
        return None
    parts = [] if stem == "__init__" else [stem]
    while os.path.isfile(os.path.join(directory, "__init__.py")):
        directory, package = os.path.split(directory)
        if not package.isidentifier():
            return None
        parts.insert(0, package)
    return directory, ".".join(parts)


def _in_package(packaged: tuple[str, str], class_name: str) -> str:
    """What to name for a module file of a package, imported from ``packaged``'s directory."""
    directory, dotted = packaged
    return (f"it is module {dotted} of a package (its directory holds an __init__.py): run "
            f"from {directory} and name {dotted}:{class_name} (or put {directory} on the "
            f"path: PYTHONPATH={directory})")


def _found_above(root: str, module_name: str, depth: int = 5) -> str:
    """``; acme.charts.door is /src/acme/charts/door.py, imported from /src, above this
    directory: run from there ...`` when ``module_name`` is a module of a directory above
    ``root`` (at most ``depth`` up): the command was run from inside the project (its
    package), where the top package is not importable; "" when none is."""
    directory = root
    for _ in range(depth):
        parent = os.path.dirname(directory)
        if parent == directory:
            return ""
        directory = parent
        if _is_module_file(directory, module_name):
            base = os.path.join(directory, *module_name.split("."))
            shown = (base + ".py" if os.path.isfile(base + ".py")
                     else os.path.join(base, "__init__.py"))
            return (f"; {module_name} is {shown}, imported from {directory}, above this "
                    f"directory: run from there (or put it on the path: "
                    f"PYTHONPATH={directory})")
    return ""


def _is_module_file(root: str, dotted: str) -> bool:
    """Whether ``dotted`` names a module file under ``root`` (``a/b.py`` or ``a/b/__init__.py``),
    looked up without importing anything."""
    base = os.path.join(root, *dotted.split("."))
    return os.path.isfile(base + ".py") or os.path.isfile(os.path.join(base, "__init__.py"))


def _module_under(root: str, path: str) -> str | None:
    """The dotted module name ``import`` finds file ``path`` (``pkg/chart.py``, ``pkg/chart``)
    by from ``root``, or None when it is not a module file under ``root`` (outside it, a
    part that is no identifier)."""
    full = os.path.normpath(os.path.join(root, path))
    if not full.endswith(".py"):
        full += ".py"
    if not os.path.isfile(full):
        return None
    relative = os.path.relpath(full, root)[:-len(".py")]
    parts = relative.split(os.sep)
    if not all(part.isidentifier() for part in parts):
        return None  # "..", a dash, ...: not importable by this name from root
    return ".".join(parts)
