"""Process-local state shared by a Ray Serve replica and the request router in its process.

Ray Serve pickles a deployment's request-router class *by value* (its module is registered
with cloudpickle's pickle-by-value while the config is serialized), so inside a replica the
router is a copy whose module globals are not the real module's. State the replica and its
router must share therefore lives here, in a module that is pickled by reference: the
replica's own id (a relay never routes back to the relaying replica) and the routers of this
process (to ask whether a sibling that serves is known). No Ray import: plain objects with
``app_name`` and ``curr_replicas`` (Serve's ``RequestRouter``) are all it reads.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

_mu = threading.Lock()
_self_replica: Any = None
_routers: weakref.WeakSet[Any] = weakref.WeakSet()


def set_self_replica(replica_id: Any) -> None:
    """Record this process's replica id (a replica's constructor calls it)."""
    global _self_replica
    with _mu:
        _self_replica = replica_id


def self_replica() -> Any:
    """This process's replica id, or None outside a replica (e.g. in a Serve proxy)."""
    with _mu:
        return _self_replica


def register_router(router: Any) -> None:
    """Remember a request router created in this process (weakly)."""
    with _mu:
        _routers.add(router)


def routers() -> list[Any]:
    """The live request routers of this process."""
    with _mu:
        return list(_routers)
