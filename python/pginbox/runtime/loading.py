"""`load_object("module:attribute")`: what a setting names by its import path (a Python handler, a
destination's callable or factory, `--callable`)."""

from __future__ import annotations

import importlib

__all__ = ["load_object"]


def load_object(spec: str, what: str = "object") -> object:
    """The object `module:attribute` (the attribute may be dotted: `module:Class.method`). Raises
    ValueError saying what is wrong: the form, a missing module or attribute, not callable."""
    module_name, colon, attribute = str(spec).partition(":")
    if not colon or not module_name or not attribute:
        raise ValueError(f"{what} must be 'module:function', got {spec!r}")
    try:
        found: object = importlib.import_module(module_name)
        for part in attribute.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{what} {spec!r}: {exc}") from None
    if not callable(found):
        raise ValueError(f"{what} {spec!r}: {attribute} is not callable")
    return found
