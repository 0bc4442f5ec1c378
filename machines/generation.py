"""One model generation: everything the executor builds for a calbin, scoped together (§9.2).

A ``Generation`` owns the loaded calbin, the contracts resolved from the manifest, the models
by task kind, the KvManager, the buffer pool and the KV coordinator of one generation id.
Jobs keep a reference to the generation they were admitted into, so a completion from an
old generation only ever touches that generation's pool and KV (FI14), never the new one's.

``open_generation`` builds one through the driver (FI01: the manifest is resolved against
``GetAllModels`` before ``configure``). ``Generation.release`` tears it down once the runtime
holds none of its buffers; host storage of slots that were in flight stays referenced by the
generation object, which the executor keeps among its retired generations until the runtime
proves no DMA into it is pending (``Device.dma_quiescent``), so a stale DMA that lands after a
reset writes into live memory the executor never reads again, never into reused memory.

Fencing (issue 13): a request thread works on a generation's pool and KV only between
``DeviceExecutor._enter`` and ``_exit``, which count ``users`` under ``submit_mu``. A recovery
sets ``closing`` under the same lock, then waits (bounded) for ``users`` to reach 0: after that
no request thread can lease, prepare or queue anything of this generation, and its teardown
cannot pull buffers from under one.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable

from calexec.contracts import fields
from calexec.contracts.codes import describe
from calexec.contracts.errors import Category, classify
from calexec.contracts.manifest import Manifest
from calexec.contracts.status import Phase, Status
from calexec.contracts.types import EngineSlot, ModelGeneration, TaskKind
from calexec.machines.device_api import CalbinApi, DeviceApi, KvManagerApi, ModelApi, no_object
from calexec.machines.kv import KvCoordinator
from calexec.machines.locks import LockOrder
from calexec.machines.pool import BufferPool
from calexec.machines.served_files import CALBIN_CHANGED

#: the code of a generation whose calbin the runtime did not load (``CalbinLoad``: the file
#: is missing, unreadable or not a calbin the runtime takes, or the runtime failed loading
#: it); the category is the §8 row of the raw code (ARTIFACT: the file's fault)
CALBIN_LOAD_FAILED = "calrt.calbin_load_failed"
#: the code of a generation whose loaded calbin's models the runtime cannot describe
#: (``ModelApi.info`` raised: introspection refused, a name that is no UTF-8); ARTIFACT
MODEL_INFO_FAILED = "calrt.model_info_failed"


def calbin_load_failed(rc: int, calbin_path: str, generation_id: int) -> Status:
    """The failure of a ``calbin load`` of ``calbin_path`` that returned ``rc``: code
    :data:`CALBIN_LOAD_FAILED` (not ``calrt.configure_failed``: the call that failed is the
    load, and a caller such as ``calexec serve --calbin`` names the file by this code)."""
    return Status.failure(CALBIN_LOAD_FAILED, classify(rc).category, Phase.CONFIGURE,
                          f"CalRT calbin load returned {describe(rc)}: {calbin_path!r}",
                          raw=rc, generation=generation_id)


class Generation:
    """The runtime objects and controllers of one generation id."""

    __slots__ = ("contracts", "calbin_path", "calbin", "models", "kv", "pool", "kvc",
                 "users", "closing", "released", "__weakref__")

    def __init__(self, contracts: ModelGeneration, calbin_path: str, calbin: CalbinApi,
                 models: dict[TaskKind, ModelApi], kv: KvManagerApi, pool: BufferPool,
                 kvc: KvCoordinator) -> None:
        self.contracts = contracts
        self.calbin_path = calbin_path
        self.calbin = calbin
        self.models = models
        self.kv = kv
        self.pool = pool
        self.kvc = kvc
        #: request threads inside enqueue working on this generation (submit_mu)
        self.users = 0
        #: fenced: no request thread may enter, no job of it may be queued (submit_mu)
        self.closing = False
        #: torn down: runtime objects destroyed, only host storage left
        self.released = False

    @property
    def id(self) -> int:
        return self.contracts.generation_id

    @property
    def sha256(self) -> str:
        return self.contracts.calbin_sha256

    def release(self, device: DeviceApi) -> Status:
        """Tear down once the runtime no longer uses any buffer of this generation (drained,
        or after a confirmed reset): slots retired, KvManager destroyed, configuration dropped,
        calbin unloaded. Host storage stays alive with this object."""
        self.closing = True
        self.pool.quarantine_all()
        held = self.pool.retire_quarantined()
        if held:  # the runtime says it still uses these: nothing of the generation is freed
            return Status.failure(
                "recovery.buffers_in_use", Category.DEVICE, Phase.RECOVERY,
                f"the runtime still uses {len(held)} buffer slot(s) of generation {self.id} "
                f"({', '.join(str(s.slot_id) for s in held)}); teardown refused",
                generation=self.id)
        self.kvc.close()
        self.released = True
        status = Status.OK
        for what, rc in (("KvManager destroy", self.kv.destroy()),
                         ("reset_configuration", device.reset_configuration()),
                         ("calbin unload", self.calbin.unload())):
            if rc != 0 and status.ok:
                status = Status.from_calrt(rc, Phase.RECOVERY, what, generation=self.id)
        return status

    def discard(self) -> None:
        """Drop the host storage of a released generation that is no longer kept for stale
        DMA (only after ``release``: nothing of it is mapped into the runtime any more)."""
        self.pool.drop_storage()

    def __repr__(self) -> str:
        return f"Generation(id={self.id}, calbin={self.calbin_path!r})"


def _load_may_wait(calbin_path: str) -> str | None:
    """Why the runtime's loader, given ``calbin_path``, may wait for ever (a FIFO no one
    writes to blocks its open; a character device such as ``/dev/zero`` never ends; a
    socket), else None: the path is a regular file, a directory (the loader refuses it at
    once), or ``stat`` says nothing (missing, unreadable: the loader answers that itself).
    A start or switch given such a path (``DeviceExecutor.switch_model``: an embedder's
    call, or a file replaced after ``POST /admin/reload``'s check) waited inside the loader,
    the lifecycle in Configuring with the previous generation torn down: nothing served."""
    try:
        mode = os.stat(calbin_path).st_mode
    except (OSError, ValueError):
        return None
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return None
    return (f"not a regular file (mode {stat.filemode(mode)}), whose read may never end; a "
            "calbin is a regular file")


def open_generation(device: DeviceApi, manifest: Manifest, calbin_path: str, generation_id: int,
                    slots_per_kind: int, locks: LockOrder,
                    engines: tuple[EngineSlot, ...] = (EngineSlot.AUTO,),
                    load_from: str | None = None,
                    served_sha256: str | None = None) -> Generation | Status:
    """Load, resolve (exact names, before configure), configure, create KV and pool.

    A restore (a recovery, a roll back: machines/served_files.py) loads ``load_from`` (the
    file that served, held open) for ``calbin_path`` and refuses a calbin whose sha256 is
    not ``served_sha256`` (``calbin.changed``) before anything is configured."""
    ctx = {"generation": generation_id}
    source = calbin_path if load_from is None else load_from
    waits = _load_may_wait(source)
    if waits is not None:
        return Status.failure(CALBIN_LOAD_FAILED, Category.ARTIFACT, Phase.CONFIGURE,
                              f"calbin load of {calbin_path!r} not attempted: {waits}",
                              generation=generation_id)
    rc, calbin = device.load_calbin(source)
    if rc != 0:
        return calbin_load_failed(rc, calbin_path, generation_id)
    if calbin is None:
        return no_object(f"calbin load {calbin_path!r}", Phase.CONFIGURE, **ctx)
    done: list[Callable[[], int]] = [calbin.unload]

    def undo(status: Status) -> Status:
        for teardown in reversed(done):
            teardown()
        return status

    if served_sha256 is not None and calbin.sha256 != served_sha256:
        return undo(Status.failure(
            CALBIN_CHANGED, Category.ARTIFACT, Phase.CONFIGURE,
            f"calbin {fields.shown(calbin_path, 300)} no longer holds the calbin that served "
            f"from it (sha256 {served_sha256[:16]}..., the file now {calbin.sha256[:16]}...): "
            "it was written over in place since, and a recovery or roll back restores only "
            "what served; write a new calbin to a new path, or to a new file renamed over the "
            "old one (mv), and reload it", **ctx))

    rc, models = calbin.models()
    if rc != 0:
        return undo(Status.from_calrt(rc, Phase.LOOKUP, "GetAllModels", **ctx))
    try:  # (a RuntimeError came out of the switch, the lifecycle left in Configuring)
        infos = [m.info for m in models]
    except RuntimeError as err:
        return undo(Status.failure(MODEL_INFO_FAILED, Category.ARTIFACT, Phase.LOOKUP,
                                   f"the models of calbin {calbin_path!r} cannot be read: {err}",
                                   **ctx))
    contracts = manifest.resolve(infos, generation_id=generation_id,
                                 calbin_sha256=calbin.sha256)
    if isinstance(contracts, Status):
        return undo(contracts)
    by_name = {m.info.name: m for m in models}
    by_kind = {kind: by_name[sub.exact_name] for kind, sub in contracts.submodels.items()}
    rc = device.configure(calbin)
    if rc != 0:
        return undo(Status.from_calrt(rc, Phase.CONFIGURE, "configure", **ctx))
    done.append(device.reset_configuration)
    rc, kv = device.create_kv(calbin)
    if rc != 0:
        return undo(Status.from_calrt(rc, Phase.CONFIGURE, "KvManager create", **ctx))
    if kv is None:
        return undo(no_object("KvManager create", Phase.CONFIGURE, **ctx))
    done.append(kv.destroy)
    pool = BufferPool(contracts, by_kind, {kind: slots_per_kind for kind in contracts.submodels},
                      locks, engines)
    status = pool.open()
    if not status.ok:
        return undo(status)
    return Generation(contracts, calbin_path, calbin, by_kind, kv, pool,
                      KvCoordinator(kv, generation_id, locks))
