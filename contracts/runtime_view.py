"""What a runtime reports about its models, as pure values.

The cffi driver converts CalRT's ``GetAllModels`` answer into these types; the manifest
loader (``calexec.contracts.manifest``) checks them against the manifest without ever
touching cffi. Shared by the driver and the contracts, so neither imports the other.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import SupportsInt

import attrs


def _tuple_of_ints(value: Iterable[SupportsInt]) -> tuple[int, ...]:
    return tuple(int(v) for v in value)


@attrs.frozen
class RuntimeTensorInfo:
    """One tensor of a runtime model, as the runtime reports it."""

    name: str
    shape: tuple[int, ...] = attrs.field(converter=_tuple_of_ints)
    dtype: str  # "S32", "BF16", "F32", "U8", ... (calexec.contracts dtype names)
    byte_size: int
    sliceable: bool


@attrs.frozen
class RuntimeModelInfo:
    """One model (compiled graph) of a calbin, as ``GetAllModels`` reports it."""

    name: str
    inputs: tuple[RuntimeTensorInfo, ...] = attrs.field(converter=tuple[RuntimeTensorInfo, ...])
    outputs: tuple[RuntimeTensorInfo, ...] = attrs.field(converter=tuple[RuntimeTensorInfo, ...])
    csr_names: tuple[str, ...] = attrs.field(converter=tuple[str, ...])
    # Graph metadata, e.g. {"logits_tile_d0": 16, "max_seq": 40960, "max_batch": 1}.
    meta: dict[str, int] = attrs.field(factory=dict, hash=False)
