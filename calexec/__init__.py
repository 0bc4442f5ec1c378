"""calexec: explicit state-machine control core of a Calculet NPU inference executor.

Layers (imports point inward only): ``calexec.contracts`` (pure values and rules),
``calexec.machines`` (declared statecharts and the controllers that own them),
``calexec.drivers`` (cffi CalRT driver, threads, CLI).
"""

__version__ = "0.1.0"
