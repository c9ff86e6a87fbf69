"""One error hierarchy: every error class pginbox defines lives in pginbox.errors and is a
PginboxError carrying `.sqlstate` (no database needed)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import psycopg
import pytest

import pginbox
from pginbox import errors

# Not errors of pginbox (see the pginbox.errors docstring): the transaction protocol's internal
# signals and the exceptions the demo's own handlers and simulated crashes raise.
NOT_PGINBOX_ERRORS = {
    "pginbox.client.protocol.Transient",
    "pginbox.client.protocol.CommitUnknown",
    "pginbox.integrations.django._HandlerError",  # carries the handler's verdict out of atomic()
    "pginbox.ops.granted_repair_async._HandlerFailed",  # a repair grant's handler failed: recorded, never raised out
    "pginbox.ops.python_replay_async._HandlerFailed",  # a replay item's handler failed: recorded, never raised out
    "pginbox.demo.act2_simulation._Crash",
    "pginbox.demo.act3_outbox.HandlerRefused",
}


def defined_exceptions() -> dict[str, type[BaseException]]:
    found: dict[str, type[BaseException]] = {}
    for info in pkgutil.walk_packages(pginbox.__path__, "pginbox."):
        if info.name == "pginbox.__main__":
            continue  # running it would start the CLI
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            if inspect.isclass(value) and issubclass(value, BaseException) and value.__module__ == info.name:
                found[f"{info.name}.{name}"] = value
    return found


def test_every_error_class_lives_in_pginbox_errors() -> None:
    outside = sorted(set(defined_exceptions()) - NOT_PGINBOX_ERRORS)
    assert outside and all(name.startswith("pginbox.errors.") for name in outside), outside


def test_every_error_is_a_pginbox_error_with_a_sqlstate() -> None:
    classes = [getattr(errors, name) for name in errors.__all__ if inspect.isclass(getattr(errors, name))]
    assert len(classes) >= 17
    # The one warning: a newer, compatible schema (pginbox.schema.compat).
    warnings = [cls for cls in classes if issubclass(cls, Warning)]
    assert warnings == [errors.SchemaNewerWarning] and issubclass(errors.SchemaNewerWarning, UserWarning)
    for cls in classes:
        if cls not in warnings:
            assert issubclass(cls, errors.PginboxError), cls
    assert errors.PginboxError("x").sqlstate is None
    assert errors.PginboxError("x", sqlstate="40001").sqlstate == "40001"


def test_claim_error_is_still_a_runtime_error() -> None:
    with pytest.raises(RuntimeError):
        raise errors.ClaimError("claims kept failing", sqlstate="57P01")


def test_operator_errors_name_the_condition() -> None:
    refused = errors.OperatorError("entry 7 is already discarded", sqlstate="55000")
    assert str(refused) == "entry 7 is already discarded [SQLSTATE 55000 object_not_in_prerequisite_state]"
    assert refused.sqlstate == "55000"
    assert str(errors.ReplayStopped("stopped", sqlstate="IR001")).endswith("[SQLSTATE IR001 replay_handler_changed]")
    assert str(errors.OperatorError("odd", sqlstate="XX999")) == "odd [SQLSTATE XX999]"
    assert str(errors.OperatorError("no database involved")) == "no database involved"
    assert issubclass(errors.ReplayError, errors.OperatorError)


def test_database_error_follows_causes_and_with_context_the_errors_being_handled() -> None:
    db = psycopg.errors.UniqueViolation("duplicate key")
    caused = errors.ReplayError("refused")
    caused.__cause__ = db
    handled = RuntimeError("raised while handling it")
    handled.__context__ = db
    assert errors.database_error(db) is db
    assert errors.database_error(caused) is db and errors.database_error(caused, context=False) is db
    assert errors.database_error(handled) is db
    assert errors.database_error(handled, context=False) is None
    looped = ValueError("a cycle")
    looped.__cause__ = RuntimeError("back")
    looped.__cause__.__cause__ = looped
    assert errors.database_error(looped) is None
    # SQLAlchemy's DBAPIError carries the driver's error as `orig`.
    wrapped = RuntimeError("(psycopg.errors.UniqueViolation) duplicate key")
    wrapped.orig = db  # type: ignore[attr-defined]
    assert errors.database_error(wrapped, context=False) is db
