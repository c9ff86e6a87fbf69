"""A destination for the `pginbox dispatch --callable` subprocess test: appends each delivered
effect id to the file named by $PGINBOX_TEST_SINK."""

from __future__ import annotations

import os
import time

from pginbox.dispatcher import Effect


def record(effect: Effect) -> None:
    with open(os.environ["PGINBOX_TEST_SINK"], "a", encoding="utf-8") as sink:
        sink.write(effect.effect_id + "\n")


def slow_record(effect: Effect) -> None:
    """Marks the start in $PGINBOX_TEST_SINK.started, takes a second, then records."""
    with open(os.environ["PGINBOX_TEST_SINK"] + ".started", "a", encoding="utf-8") as started:
        started.write(effect.effect_id + "\n")
    time.sleep(1.0)
    record(effect)
