"""Whether a calbin path can be switched to, checked on the host before the lifecycle moves.

``check_calbin`` (``DeviceExecutor.check_calbin``) refuses what a model switch would refuse
at its first step, loading and resolving the calbin, without touching the device, the
generation or the lifecycle: a path that is not an existing, non-empty, readable regular file
(stat first: a FIFO, a device such as /dev/zero or a directory is never opened; a /proc or
sysfs file, whose size stat gives as 0, is read one byte to tell it from an empty one), a file the
runtime says is not a calbin (``runtime.inspect_calbin``, when the runtime offers it: the
bundled emulator runs its own loader on a scratch device; a vendor shim's second device would
be hardware, so only the file and the manifest's sha256 pin are checked there), and a calbin
the manifest does not describe (``Manifest.resolve``: missing, extra or mismatched models, a
sha256 other than the pinned one; the file is hashed only when the manifest pins a sha256,
after every other check: unpinned, the check reads its first bytes in Python and the loader
what it reads, never a large file whole). What it cannot see (the golden run, buffers that do not
map, the emulator's execution contract, checked at configure) is still refused by the switch,
which rolls back.

``calexec serve --calbin`` runs the check before the executor's start without the sha256 pin
(``hash_pin=False``: the start hashes the file as it loads it), and names what only the start
can see (a vendor runtime's loader, the pin) with :func:`start_refusal`, worded as the check's.

Every refusal is a ``Status`` (INVALID_REQUEST, phase VALIDATE: HTTP 400) whose code is
``calbin.<reason>`` and whose message starts ``calbin=<path>:``, the path as JSON writes it
(``calbin="m.calbin": no such file``: :func:`named`); nothing raises.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Callable

from calexec.contracts.codes import CalrtCode, describe
from calexec.contracts.errors import Category
from calexec.contracts.fields import shown as as_json
from calexec.contracts.manifest import Manifest
from calexec.contracts.runtime_view import RuntimeModelInfo
from calexec.contracts.status import Phase, Status
from calexec.machines.generation import CALBIN_LOAD_FAILED, MODEL_INFO_FAILED

#: longest path accepted (Linux PATH_MAX)
MAX_PATH_CHARS = 4096
_CHUNK = 1 << 20


def refused(reason: str, shown: str, message: str) -> Status:
    """The failure ``calbin.<reason>``: ``calbin=<shown>: <message>``."""
    return Status.failure(f"calbin.{reason}", Category.INVALID_REQUEST, Phase.VALIDATE,
                          f"calbin={shown}: {message}")


def named(path: object) -> str:
    """``path`` as a refusal names it (``calbin=<named>: ...``): as JSON writes it, the way
    the HTTP client of ``POST /admin/reload`` wrote it (``"m.calbin"``, ``null``; until stop
    59 Python's ``'m.calbin'``, ``None``), a str cut to its first 200 characters. A caller
    rewording a refusal (``calexec serve --calbin``) strips ``calbin=<named>: `` with it."""
    if not isinstance(path, str):
        return as_json(path, 200)
    return as_json(path[:200], 2000) + ("..." if len(path) > 200 else "")


def _file_refusal(path: object, max_bytes: int | None) -> Status | None:
    if not isinstance(path, str) or not path:
        return refused("path_required", named(path),
                       "a calbin file path (a non-empty string) is required")
    shown = named(path)
    if "\x00" in path:
        return refused("bad_path", shown, "the path contains a NUL character")
    if len(path) > MAX_PATH_CHARS:
        return refused("bad_path", shown, f"the path is longer than {MAX_PATH_CHARS} characters")
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return refused("not_found", shown, "no such file")
    except (OSError, ValueError) as err:
        return refused("unreadable", shown, f"cannot stat the file ({err})")
    if not stat.S_ISREG(info.st_mode):
        return refused("not_a_file", shown,
                       f"not a regular file (mode {stat.filemode(info.st_mode)})")
    if info.st_size == 0:
        return _size_zero(path, shown)
    if max_bytes is not None and info.st_size > max_bytes:
        return refused("too_large", shown, f"{info.st_size} bytes > max_calbin_bytes={max_bytes}")
    if not os.access(path, os.R_OK):
        return refused("unreadable", shown, "the file is not readable by the server")
    return None


def _size_zero(path: str, shown: str) -> Status:
    """The refusal of a regular file whose size ``stat`` gives as 0: empty, or (one byte read
    without blocking says so) a file the kernel makes up as it is read, whose size is no bound
    on what a read returns: /proc's and sysfs's (``/proc/self/environ``) were refused "the file
    is empty" until stop 67. A calbin is a file with a size (``max_calbin_bytes`` is checked
    on it), so one without is refused ``calbin.not_a_file``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as err:
        return refused("unreadable", shown, f"cannot read the file ({err.strerror or err})")
    try:
        first = os.read(fd, 1)
    except BlockingIOError:
        first = b"?"  # (a read that would wait: no file on a disk either)
    except OSError as err:
        return refused("unreadable", shown, f"cannot read the file ({err.strerror or err})")
    finally:
        os.close(fd)
    if not first:
        return refused("empty", shown, "the file is empty")
    return refused("not_a_file", shown,
                   "its size is given as 0 but a read returns bytes: a file made up as it is "
                   "read (/proc, sysfs), not a calbin file on a disk")


#: bytes of the file the check reads to see that it can be read (all it reads in Python
#: unless the manifest pins a sha256: the runtime's loader reads what it needs its own way)
_PROBE = 64


def _unreadable(fd: int) -> str | None:
    """Why the first bytes of the file open as ``fd`` cannot be read (``os.access`` is not
    the whole answer: a read can still fail), else None."""
    try:
        os.pread(fd, _PROBE, 0)
    except OSError as err:
        return err.strerror or str(err)
    return None


def _sha256(fd: int) -> str | OSError:
    digest = hashlib.sha256()
    offset = 0
    try:
        while chunk := os.pread(fd, _CHUNK, offset):
            digest.update(chunk)
            offset += len(chunk)
    except OSError as err:
        return err
    return digest.hexdigest()


def check_calbin(runtime: object, manifest: Manifest, path: object,
                 max_bytes: int | None = None, hash_pin: bool = True) -> Status:
    """``Status.OK`` when ``path`` passes every check above, else the ``calbin.<reason>``
    failure naming the first one it fails (module docstring); ``max_bytes``: the largest file
    accepted (None: no bound). A ``pathlib.Path`` (any ``os.PathLike``) is taken as its str,
    as ``switch_model`` takes it (it was refused ``calbin.path_required``). ``hash_pin``
    False: the file is not hashed for the manifest's sha256 pin, so the check never reads it
    whole; for a caller whose next step loads the file anyway (the executor's start, which
    hashes it as it loads it and refuses a mismatch: :func:`start_refusal` names it)."""
    if isinstance(path, os.PathLike):
        path = os.fspath(path)
    status = _file_refusal(path, max_bytes)
    if status is not None:
        return status
    if not isinstance(path, str):  # (_file_refusal refused it; said again for the types)
        return refused("path_required", named(path), "a calbin file path is required")
    shown = named(path)
    try:  # (stat said a regular file: no wait; O_NONBLOCK if it was replaced by a FIFO since)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except (OSError, ValueError) as err:
        return refused("unreadable", shown, f"cannot read the file ({_why(err)})")
    try:
        return _open_file_refusal(runtime, manifest, fd, path, max_bytes,
                                  hash_pin) or Status.OK
    finally:
        os.close(fd)


def _why(err: Exception) -> str:
    return (err.strerror if isinstance(err, OSError) else None) or str(err)


def _open_file_refusal(runtime: object, manifest: Manifest, fd: int, path: str,
                       max_bytes: int | None, hash_pin: bool) -> Status | None:
    """The rest of :func:`check_calbin`, on the file the path names, open as ``fd``: what is
    read (the first bytes, the runtime's loader, the sha256) is the file the checks are of.
    Each read opened the path anew until stop 71: a file replaced between the ``stat`` and
    an open by a FIFO (a ``POST /admin/reload`` path an operator's script rewrites) held the
    check in that open, the reload never answered; it is now ``calbin.not_a_file``."""
    shown = named(path)
    try:
        info = os.fstat(fd)
    except OSError as err:
        return refused("unreadable", shown, f"cannot stat the file ({_why(err)})")
    if not stat.S_ISREG(info.st_mode):
        return refused("not_a_file", shown, f"not a regular file (mode "
                       f"{stat.filemode(info.st_mode)}): the path was replaced while it "
                       "was checked")
    if info.st_size == 0:
        return refused("empty", shown, "the file is empty")
    if max_bytes is not None and info.st_size > max_bytes:
        return refused("too_large", shown, f"{info.st_size} bytes > max_calbin_bytes={max_bytes}")
    unreadable = _unreadable(fd)
    if unreadable is not None:
        return refused("unreadable", shown, f"cannot read the file ({unreadable})")
    inspect: Callable[[str], tuple[RuntimeModelInfo, ...] | str | None] | None = getattr(
        runtime, "inspect_calbin", None)
    # (the loader reads the file open as ``fd``, a new open of it through /proc, as the
    # switch's load does: given the path again it read whatever was there by then, a FIFO
    # answered "the loader refused it (ERR_FILE_READ)", until stop 71)
    opened = f"/proc/self/fd/{fd}"
    models = (inspect(opened if os.path.exists(opened) else path) if inspect is not None
              else None)
    if isinstance(models, str):
        return refused("invalid", shown, f"not a calbin the runtime loads: {models}")
    pinned = manifest.calbin_sha256 if hash_pin else None
    if pinned is None:  # nothing pins the content: the file is not hashed (the switch does)
        refusal = None if models is None else manifest.models_refusal(models)
        if refusal is not None:
            return refused("manifest_mismatch", shown,
                           f"{refusal.code}: {refusal.message or refusal.code}")
        return None
    sha = _sha256(fd)  # the pin is on the whole content: read whole, last
    if isinstance(sha, OSError):
        return refused("unreadable", shown, f"cannot read the file ({sha.strerror or sha})")
    if models is None:  # the runtime cannot read it on the host: the sha256 pin alone
        if sha != pinned:
            return refused("manifest_mismatch", shown,
                           f"manifest.sha256_mismatch: calbin_sha256={sha} but "
                           f"{manifest.source} pins {pinned}")
        return None
    resolved = manifest.resolve(models, generation_id=0, calbin_sha256=sha)
    if isinstance(resolved, Status):
        return refused("manifest_mismatch", shown,
                       f"{resolved.code}: {resolved.message or resolved.code}")
    return None


def start_refusal(status: Status, path: str) -> Status | None:
    """The ``calbin.<reason>`` refusal (as :func:`check_calbin` words it) that a failed start
    or switch of ``path`` is when the calbin is what was refused, else None: the runtime's
    loader refused the file (``calrt.calbin_load_failed`` with an ARTIFACT code: missing,
    unreadable, not a calbin; ``calbin.invalid``; or its models cannot be read,
    ``calrt.model_info_failed``: a name that is no UTF-8), or the manifest does not describe what it
    loaded (``manifest.<reason>``, the sha256 pin included: ``calbin.manifest_mismatch``).
    A vendor runtime's loader runs only there (its check on the host would need a second
    device), and a start does not read the file once more for a check of its own."""
    shown = named(path)
    if status.code == CALBIN_LOAD_FAILED and status.category is Category.ARTIFACT:
        return refused("invalid", shown, "not a calbin the runtime loads: the loader refused "
                       f"it ({_rc_name(status.raw)})")
    if status.code == MODEL_INFO_FAILED:  # (its models' names or shapes cannot be read)
        return refused("invalid", shown, f"not a calbin the runtime loads: {status.message}")
    if status.code.startswith("manifest."):
        return refused("manifest_mismatch", shown,
                       f"{status.code}: {status.message or status.code}")
    return None


def _rc_name(raw: int | None) -> str:
    """A raw CalRT code as the runtime's loader check names it (``ERR_FILE_FORMAT``)."""
    if raw is None:
        return "no code"
    try:
        return f"ERR_{CalrtCode(raw).name}"
    except ValueError:
        return describe(raw)
