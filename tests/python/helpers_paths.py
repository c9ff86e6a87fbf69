"""Where the tests find things, whichever tier (unit/, integration/, e2e/) a test lives in.

TESTS_DIR   tests/python: conftest, the helpers_*.py modules and the scripts subprocesses run
            (_crash_child.py, _celery_app.py, _dispatch_sink.py, billing_handlers.py ...).
REPO_ROOT   the checkout.
pythonpath  PYTHONPATH for a subprocess that imports a helper or a test module by name
            (`handler = "test_kafka:slow_credit"`, `_dispatch_sink:record`).
"""

from __future__ import annotations

import os
from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parents[1]
TIERS = ("unit", "integration", "e2e")


def pythonpath() -> str:
    """tests/python and each tier's folder, then the caller's PYTHONPATH."""
    dirs = [str(TESTS_DIR), *(str(TESTS_DIR / tier) for tier in TIERS)]
    inherited = os.environ.get("PYTHONPATH", "")
    return os.pathsep.join([*dirs, inherited] if inherited else dirs)
