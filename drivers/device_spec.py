"""What a command-line entry point opens: the runtime library, the manifest, the calbin, and
the reset the executor may use on it (spec §9.1).

``DeviceSpec`` is built from the shared flags (``--runtime-lib``, ``--manifest``, ``--calbin``,
and for ``serve`` ``--reset-kind`` / ``--conform-report``); every default is the bundled
emulator with its synthetic Qwen3 calbin and packaged manifest. ``check()`` validates every path
before anything opens a device and raises :class:`DeviceSpecError` naming the flag and value.

The reset rule (§9.1, issue 13): the bundled emulator's resets are known safe (its conformance
run proves them), so it keeps ``RecoveryPolicy``'s default. For an external runtime library
(``--runtime-lib`` or ``$CALEXEC_CALRT_LIB``) nobody knows whether a reset aborts the device's
jobs without a stale DMA write: the reset kind comes from ``--reset-kind`` or from the verdicts
of a ``calexec conform`` report; with neither, ``reset_kind="none"``, so a device fault that
needs a reset ends the lifecycle ``Failed`` and ``calexec serve`` exits for its supervisor.
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING, Any

import attrs

from calexec.contracts.manifest import Manifest, default_manifest_path, load_manifest
from calexec.drivers.calrt.runtime import ENV_LIB, CalRT
from calexec.drivers.synthetic import calbin as calbin_fmt
from calexec.machines.faults import RecoveryPolicy

if TYPE_CHECKING:
    from calexec.machines.device_api import RuntimeApi
    from calexec.machines.executor import ExecutorConfig

RESET_KINDS = ("reset", "reset_ccu", "reset_configuration", "none")


class DeviceSpecError(ValueError):
    """A bad entry-point setting; the message names the flag and the value (one line)."""


#: the emulator's latency keys (docs/emulator.md section 7), each in microseconds
LATENCY_KEYS = ("h2d_us", "prefill_per_token_us", "decode_us", "d2h_us")


#: the longest device config string the bundled emulator reads (``parse_config``'s buffer is
#: 1024 bytes with its NUL; one more and ``calrt_device_open`` returns 5, whatever the keys)
EMU_CONFIG_MAX_BYTES = 1023


#: a value as the emulator reads it (``strtoll``, base 10, nothing after the digits): leading
#: blanks, a sign and leading zeros are taken (``decode_us=+20000000`` is 20 s); ``_``, non-ASCII
#: digits and trailing blanks, which Python's ``int`` would take, are not
_C_INTEGER = re.compile(r"[ \t\n\v\f\r]*([+-]?[0-9]+)")


def emulated_latency_us(device_config: str) -> dict[str, int]:
    """The emulator latency keys ``device_config`` (``"k=v;k=v"``) sets, in microseconds, read
    as the emulator reads them (the last of a key given twice; a value that is no integer >= 0
    is left out: the runtime refuses it when it opens)."""
    latency: dict[str, int] = {}
    for item in device_config.split(";"):
        key, _, value = item.partition("=")
        number = _C_INTEGER.fullmatch(value)
        if key.strip() in LATENCY_KEYS and number is not None and int(number[1]) >= 0:
            latency[key.strip()] = int(number[1])
    return latency


def with_emulated_latency(config: ExecutorConfig) -> ExecutorConfig:
    """``config`` with its deadlines moved out by the emulated latency its ``device_config``
    asks for (the emulator's ``decode_us`` and the other keys go up to 60 s): each golden job
    of the warm-up by the longest one (``golden_timeout_s``, 10 s by default, failed the start
    of a 20 s decode, exit 3, in words that named neither the flag nor the key), the
    execution deadline by a decode's and a prefill's per-token cost (``execution_timeout_s``,
    ``execution_timeout_per_token_s``: past them a slow job is taken for a hung device). A
    config without latency keys is returned as it is."""
    latency = emulated_latency_us(config.device_config)
    if not any(latency.values()):
        return config
    transfer_s = (latency.get("h2d_us", 0) + latency.get("d2h_us", 0)) / 1e6
    decode_s = latency.get("decode_us", 0) / 1e6
    per_token_s = latency.get("prefill_per_token_us", 0) / 1e6
    golden_job_s = transfer_s + max(decode_s, per_token_s * len(config.golden_tokens))
    return attrs.evolve(
        config, golden_timeout_s=config.golden_timeout_s + golden_job_s,
        execution_timeout_s=config.execution_timeout_s + transfer_s + decode_s,
        execution_timeout_per_token_s=config.execution_timeout_per_token_s + per_token_s)


#: the share of the server's request deadline (``serve --timeout``) a job may spend on the
#: device before it is taken for a hung one (``within_request_timeout``), and the least
#: execution deadline that share gives: a short ``--timeout`` must not make a busy host's
#: slow job (the start's golden among them) look like a hung device
EXECUTION_SHARE_OF_TIMEOUT = 1 / 3
EXECUTION_TIMEOUT_FLOOR_S = 5.0


def within_request_timeout(config: ExecutorConfig, timeout_s: float) -> ExecutorConfig:
    """``config`` with the base of its §9.1 execution deadline (``execution_timeout_s``) at
    most a third of the server's request deadline ``timeout_s`` (never below
    ``EXECUTION_TIMEOUT_FLOOR_S``), so a hung device is found, reset and the request resumed
    before that request's own deadline (``calexec serve`` kept the executor's 30 s beside its
    default 30 s ``--timeout``: for 30 s every request stalled behind a hung job, ``/ready``
    200, nothing logged, then all ended 504 or 503 and none resumed). Apply before
    :func:`with_emulated_latency`, which moves the deadline out by the emulated latency. A
    config already within it is returned as it is."""
    base = max(EXECUTION_TIMEOUT_FLOOR_S, timeout_s * EXECUTION_SHARE_OF_TIMEOUT)
    if base >= config.execution_timeout_s:
        return config
    return attrs.evolve(config, execution_timeout_s=base)


def _readable_file(flag: str, path: str | None) -> None:
    if path is None:
        return
    if "\0" in path:
        raise DeviceSpecError(f"{flag}={path!r}: contains a NUL byte")
    if not os.path.exists(path):
        raise DeviceSpecError(f"{flag}={path!r}: no such file")
    if not os.path.isfile(path):
        raise DeviceSpecError(f"{flag}={path!r}: not a regular file")
    if not os.access(path, os.R_OK):
        raise DeviceSpecError(f"{flag}={path!r}: not readable")


@attrs.frozen
class DeviceSpec:
    """``None`` fields mean the defaults: the packaged manifest, a freshly written synthetic
    calbin, ``$CALEXEC_CALRT_LIB`` or else the bundled emulator, and the reset rule above."""

    manifest_path: str | None = None
    calbin_path: str | None = None
    runtime_lib: str | None = None
    #: an explicit ``RecoveryPolicy.reset_kind`` (``--reset-kind``)
    reset_kind: str | None = attrs.field(default=None, validator=attrs.validators.optional(
        attrs.validators.in_(RESET_KINDS)))
    #: a ``calexec conform`` report (its directory or conformance.json): its reset verdicts
    conform_report: str | None = None

    @property
    def library(self) -> str | None:
        """The external library that will be dlopen'ed, or None for the bundled emulator."""
        return self.runtime_lib or os.environ.get(ENV_LIB) or None

    @property
    def external(self) -> bool:
        return self.library is not None

    def check(self) -> None:
        """Validate every setting without opening a device; raises DeviceSpecError."""
        if self.reset_kind is not None and self.conform_report is not None:
            self.reset()  # the conflict is named before any path
        if self.runtime_lib == "":  # (not the default: an unset variable in a script)
            raise DeviceSpecError("--runtime-lib='': empty (omit the flag for "
                                  f"${ENV_LIB} or the bundled emulator)")
        lib_flag = "--runtime-lib" if self.runtime_lib else f"${ENV_LIB}"
        _readable_file(lib_flag, self.library)
        _readable_file("--manifest", self.manifest_path)
        _readable_file("--calbin", self.calbin_path)
        _readable_file("--conform-report", None if self.conform_report is None or
                       os.path.isdir(self.conform_report) else self.conform_report)
        self.manifest()
        self.reset()

    def runtime(self) -> CalRT:
        """The loaded runtime; a library that cannot be dlopen'ed is a DeviceSpecError."""
        try:
            return CalRT.load(self.runtime_lib)
        except (OSError, AttributeError) as exc:  # dlopen failed / not a calrt.h library
            flag = "--runtime-lib" if self.runtime_lib else f"${ENV_LIB}"
            raise DeviceSpecError(f"{flag}={self.library!r}: cannot load: "
                                  f"{str(exc).splitlines()[0].split('  Additionally')[0]}") from None

    def manifest(self) -> Manifest:
        """The manifest (default: the packaged synthetic one); a bad file is a DeviceSpecError
        naming the key (``ManifestError``'s message)."""
        try:
            return load_manifest(self.manifest_path or default_manifest_path())
        except OSError as exc:
            raise DeviceSpecError(f"--manifest={self.manifest_path!r}: {exc.strerror or exc}") \
                from None
        except ValueError as exc:
            raise DeviceSpecError(f"--manifest: {exc}") from None

    def check_synthetic_calbin(self, why: str) -> None:
        """For a command that runs only the synthetic model (the emulator, the oracle): an
        explicit ``--calbin`` must be one (``calexec sim write-calbin``); ``why`` says what
        needs it. Raises DeviceSpecError naming the flag and value."""
        if self.calbin_path is None:
            return
        try:
            calbin_fmt.read(self.calbin_path)
        except (OSError, ValueError) as exc:
            raise DeviceSpecError(f"--calbin={self.calbin_path!r}: not a synthetic calbin "
                                  f"(calexec sim write-calbin), which {why}: {exc}") from None

    def calbin_refusal(self) -> str | None:
        """Why the given ``--calbin`` cannot start: the runtime's loader refuses it or the
        manifest does not describe it (the check ``serve --calbin`` and a model switch run,
        machines/switch_check.py), as one line naming the flag; None when it passes or none
        was given (the default synthetic calbin is the packaged manifest's)."""
        if self.calbin_path is None:
            return None
        from calexec.machines import switch_check

        path = self.calbin_path
        checked = switch_check.check_calbin(self.runtime(), self.manifest(), path,
                                            hash_pin=False)
        if checked.ok:
            return None
        why = checked.message.removeprefix(f"calbin={switch_check.named(path)}: ")
        return f"--calbin={path!r}: not a valid calbin ({checked.code}): {why}"

    def served(self) -> str:
        """What runs, for a banner: ``calbin 'PATH'`` or the synthetic calbin, on the bundled
        emulator or ``runtime library 'LIB'``."""
        calbin = "the synthetic calbin" if self.calbin_path is None else \
            f"calbin {self.calbin_path!r}"
        runtime = "the bundled emulator" if self.library is None else \
            f"runtime library {self.library!r}"
        return f"{calbin} on {runtime}"

    def calbin(self, tmp_dir: str) -> str:
        """``--calbin``, or the default synthetic calbin written into ``tmp_dir``."""
        if self.calbin_path is not None:
            return self.calbin_path
        path = os.path.join(tmp_dir, "synthetic.calbin")
        calbin_fmt.write(path, calbin_fmt.default_spec())
        return path

    def reset(self) -> tuple[str, str]:
        """``(reset_kind, why)`` by the rule in the module docstring."""
        if self.reset_kind is not None and self.conform_report is not None:
            raise DeviceSpecError(f"--reset-kind={self.reset_kind} and --conform-report="
                                  f"{self.conform_report!r}: give one of them, not both")
        if self.reset_kind is not None:
            return self.reset_kind, f"--reset-kind={self.reset_kind}"
        if self.conform_report is not None:
            from calexec.drivers.calrt import conformance as report

            try:
                run = report.load_run(self.conform_report)
            except report.ReportError as exc:
                raise DeviceSpecError(f"--conform-report: {exc}") from None
            if self.external and run.get("bundled"):
                raise DeviceSpecError(f"--conform-report={self.conform_report!r}: the report is "
                                      "of the bundled emulator, not of the external library "
                                      f"{self.library!r}")
            kind = report.reset_kind(run["questions"])
            return kind, (f"the conformance report {run['source']!r} of "
                          f"{run.get('runtime', '?')} ({run.get('library', '?')})")
        if self.external:
            return "none", (f"external runtime library {self.library!r} with neither "
                            "--reset-kind nor --conform-report: no reset is known to be safe "
                            "(§9.1)")
        return RecoveryPolicy().reset_kind, "the bundled emulator (its resets are known safe)"

    def recovery(self, **fields: Any) -> RecoveryPolicy:
        """A RecoveryPolicy (``fields`` override its defaults) with the resolved reset kind."""
        return RecoveryPolicy(**{"reset_kind": self.reset()[0], **fields})

    def check_device_config(self, rt: CalRT, config: str, flag: str = "--device-config") -> None:
        """Name the ``key=value`` of ``config`` (given as ``flag``) the runtime refuses: when
        ``calrt_device_open`` refuses the whole string, each item is tried alone. A key given
        twice is refused before the runtime sees it (the emulator takes the last one, so
        ``decode_us=0;...;decode_us=20000`` ran at 20 ms with no word), and a string the
        runtime refuses that the bundled emulator's buffer cannot hold
        (:data:`EMU_CONFIG_MAX_BYTES`) is named by its length. Raises DeviceSpecError."""
        if not config:
            return
        try:
            size = len(config.encode())
        except UnicodeEncodeError as err:  # (bytes of argv that are no UTF-8)
            raise DeviceSpecError(f"{flag}={config!r}: not UTF-8 text (at character "
                                  f"{err.start + 1})") from None
        # as the emulator splits it: items between ';', leading spaces skipped ("\t" is an item)
        items = [item for item in config.split(";") if item.lstrip(" ")]
        seen: dict[str, str] = {}
        for item in items:
            if "=" not in item:
                raise DeviceSpecError(f"{flag}: item {item!r} is not key=value")
            key = item.partition("=")[0].strip()
            if key in seen:
                raise DeviceSpecError(f"{flag}: {key} given more than once ({seen[key]!r}, "
                                      f"{item.strip()!r}): give each key once")
            seen[key] = item.strip()
        rc, device = rt.open_device(config)
        if rc == 0 and device is not None:
            device.close()
            return
        if size > EMU_CONFIG_MAX_BYTES:
            raise DeviceSpecError(f"{flag}: {size} bytes, refused by the runtime "
                                  f"(calrt_device_open returned {rc}); the bundled emulator "
                                  f"reads at most {EMU_CONFIG_MAX_BYTES} bytes (a 1 KiB "
                                  "buffer, docs/emulator.md)")
        for item in items:
            rc_one, one = rt.open_device(item)
            if rc_one == 0 and one is not None:
                one.close()
                continue
            key, _, value = item.partition("=")
            shown = key.strip() if key.lstrip(" ") == key.strip() else repr(key.lstrip(" "))
            blank = "" if shown == key.strip() else "; a blank in a key is part of it"
            raise DeviceSpecError(f"{flag}: {shown}={value!r} refused by "
                                  f"the runtime (calrt_device_open returned {rc_one}); the "
                                  f"emulator's keys are listed in docs/emulator.md{blank}")
        raise DeviceSpecError(f"{flag}={config!r}: refused by the runtime "
                              f"(calrt_device_open returned {rc}), though each item alone opens")


if TYPE_CHECKING:
    def _runtime_seam(runtime: CalRT) -> RuntimeApi:
        """For mypy only: the cffi driver satisfies what machines/ calls on a runtime
        (machines/device_api.py), down to its buffers."""
        return runtime
