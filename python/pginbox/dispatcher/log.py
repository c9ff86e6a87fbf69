"""The dispatcher's logger, `pginbox.dispatcher`; its lines are `kv` lines (pginbox.runtime.log)."""

from __future__ import annotations

import logging

from pginbox.runtime.log import kv

__all__ = ["kv", "log"]

log = logging.getLogger("pginbox.dispatcher")
