"""torchvision's model modules without ``torchvision/__init__`` (see tests/README.md, "torchvision").

The registry wheel's C++ ops are built against a CUDA torch, so ``import torchvision`` fails with the
CPU torch at the fake-kernel registrations of those ops (``_meta_registrations``). The models are plain
Python and never call the ops: registering the installed package directory as an empty ``torchvision``
package lets ``torchvision.models.*`` import as usual while the package ``__init__`` (which loads the
ops) never runs."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from types import ModuleType


def torchvision_module(name: str) -> ModuleType:
    """``torchvision.<name>`` (e.g. ``"models.resnet"``), imported without torchvision's ``__init__``."""
    if "torchvision" not in sys.modules:
        spec = importlib.util.find_spec("torchvision")
        if spec is None or not spec.submodule_search_locations:
            raise ImportError("torchvision is not installed (pip install -e '.[dev]')")
        pkg = types.ModuleType("torchvision")
        pkg.__path__ = list(spec.submodule_search_locations)
        pkg.__spec__ = spec
        sys.modules["torchvision"] = pkg
    return importlib.import_module(f"torchvision.{name}")
