"""Shared by the measuring tools: import trainmem.measure from this source tree.

`trainmem/__init__.py` imports the C++ extension `_core`, which exists only once the package is
built and installed. The measuring side does not need it, so when the package cannot be
imported (or an older installed copy would shadow this tree), `trainmem` is made to resolve
`trainmem.measure` from `python/trainmem/measure` here.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "python" / "trainmem"


def load_measure():
    """The trainmem.measure package of this source tree.

    The installed package (with its `_core`) is imported when there is one, and this tree's
    python/trainmem is put first on its __path__, so trainmem.measure comes from here while
    `from . import _core` still finds the built extension. Putting python/ first on sys.path
    instead would make `trainmem` this tree's copy, which has no `_core`, for every test run
    after it in the same process."""
    if "trainmem" not in sys.modules:
        try:
            importlib.import_module("trainmem")
        except ImportError:
            sys.modules.pop("trainmem", None)
            package = types.ModuleType("trainmem")
            package.__path__ = [str(SOURCE)]
            sys.modules["trainmem"] = package
    package = sys.modules["trainmem"]
    if str(SOURCE) not in list(package.__path__):
        package.__path__.insert(0, str(SOURCE))
    return importlib.import_module("trainmem.measure")


def load_phases():
    """python/trainmem/measure/phases.py of this tree, alone: it needs no torch (nor the package)."""
    spec = importlib.util.spec_from_file_location("trainmem_phases", SOURCE / "measure" / "phases.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
