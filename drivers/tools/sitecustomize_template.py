"""The ``sitecustomize.py`` the chart tools put on a test command's PYTHONPATH, so every Python
process the command starts installs their hook (``charts mutate``: a mutant; ``charts cover``:
a transition recorder). Imports nothing, so using it loads nothing into those processes."""

from __future__ import annotations


def sitecustomize_source(purpose: str, install_module: str) -> str:
    """A ``sitecustomize.py`` that calls ``install_module.install_from_env()`` in every Python
    process started with its directory on PYTHONPATH, then runs the environment's own
    ``sitecustomize`` if there is one (``charts mutate`` applies a mutant this way, ``charts
    cover`` records transitions). ``purpose``: the comment line saying who wrote it."""
    return f'''\
# Written by {purpose}
import importlib.machinery as _machinery
import importlib.util as _util
import os as _os
import sys as _sys

from {install_module} import install_from_env as _install

_install()
_here = _os.path.dirname(_os.path.abspath(__file__))
_next = _machinery.PathFinder.find_spec(
    "sitecustomize", [p for p in _sys.path if _os.path.abspath(p or ".") != _here])
if _next is not None and _next.loader is not None:  # keep the environment's own one working
    _next.loader.exec_module(_util.module_from_spec(_next))
'''
