"""Loading the scripts of python/tools/ (not a package) as modules, for the tests that call them."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

from conftest import REPO_ROOT


def load_tool(name: str) -> ModuleType:
    """python/tools/<name>.py as the module `name`."""
    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "python" / "tools" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look the module up by name
    spec.loader.exec_module(module)
    return module
