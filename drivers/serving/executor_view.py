"""The executor as the reference server sees it (issue 25, "typed seams").

``ServedExecutor`` is ``machines.api.InferenceExecutor`` (the embedder's surface: docs/
embedding.md) plus what drivers/serving/ reads beyond it. Those extra members are the
executor's own, not public API (machines/api.py says they may change): the server uses them
for features an embedder's server would not need or would do otherwise:

* ``generation``: the live generation's contracts (vocabulary size, submodels), to validate a
  request before it reaches the executor (service.py, openai_api.py);
* ``kv``: the KvManager's ``max_seqs``, to check ``--max-sequences`` at start (service.py);
* ``kvc``: the KV coordinator's host-side view, for the live chart page's KV transaction
  counts (live_charts.py; the KV usage gauge reads ``snapshot()``'s ``kv_blocks_*``);
* ``gen``, ``check_calbin`` and ``switch_model``: the admin model switch, the calbin check
  before it (a 400, nothing drained) and its answer (admin.py);
* ``config`` and ``job_trail``: the debug endpoint of one job's chart path (debug.py).
* ``recoveries``, ``recovery_totals``: fault recoveries and model switches counted apart
  (service.py, metrics.py).

``DeviceExecutor`` satisfies it: ``calexec/serve.py`` and drivers/fleet/ray_serve.py hand one
to ``create_app`` through ``served`` (where mypy checks it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from calexec.contracts.status import Status
from calexec.contracts.types import ModelGeneration
from calexec.machines.api import InferenceExecutor, JobTrail, RecoveryRecord
from calexec.machines.device_api import KvManagerApi

if TYPE_CHECKING:
    from calexec.machines.executor import DeviceExecutor, ExecutorConfig
    from calexec.machines.generation import Generation
    from calexec.machines.kv import KvCoordinator


class ServedExecutor(InferenceExecutor, Protocol):
    """``InferenceExecutor`` and the executor's own members the reference server reads (the
    module docstring says which module reads which, and why)."""

    @property
    def generation(self) -> ModelGeneration | None:
        """The current generation's contracts (None between generations)."""
        ...

    @property
    def kv(self) -> KvManagerApi | None: ...

    @property
    def kvc(self) -> KvCoordinator | None: ...

    @property
    def gen(self) -> Generation | None: ...

    @property
    def config(self) -> ExecutorConfig: ...

    def check_calbin(self, calbin_path: object, max_bytes: int | None = None) -> Status: ...

    def switch_model(self, calbin_path: str, without_rollback: bool = False) -> Status: ...

    def job_trail(self, job_id: int) -> JobTrail | None: ...

    @property
    def recoveries(self) -> list[RecoveryRecord]:
        """One record per recovery or model switch (``reason``, ``ok``, generations): the
        newest ones."""
        ...

    @property
    def recovery_totals(self) -> dict[tuple[str, bool], int]:
        """Every recovery and model switch recorded, by (reason code, ok)."""
        ...


def served(executor: DeviceExecutor) -> ServedExecutor:
    """``executor`` as the server holds it; mypy checks here that ``DeviceExecutor`` has every
    member of the protocol, with its types."""
    return executor
