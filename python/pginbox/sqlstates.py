"""Every SQLSTATE pginbox knows, in one table: its condition name, and what it means for a client.

    transient  a TransientKind: the error says nothing about the message, only about this attempt;
               the clients run the whole transaction again (pginbox.client.retry)
    bad_input  the message can never be accepted as it is: the consumer dead-letters it
               (pginbox.brokers.wire.action_for)
    neither    configuration, rights or a bug: every message would fail alike (the consumer halts)

A key is a SQLSTATE (five characters) or a class (its first two): `condition()` looks up the code,
then its class. Every SQLSTATE the SQL raises (sql/*.sql, `ERRCODE = ...`) has an entry here:
tests/python/unit/test_sqlstates.py reads them from the SQL and fails on one missing.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

__all__ = ["SQLSTATES", "Condition", "TransientKind", "condition"]


class TransientKind(enum.Enum):
    """Why an attempt failed without the message being at fault (see pginbox.client.retry)."""

    CONFLICT = "conflict"
    TIMEOUT = "timeout"
    CONNECTION = "connection"
    RESOURCES = "resources"
    POOLER = "pooler"


@dataclass(frozen=True, slots=True)
class Condition:
    name: str
    transient: TransientKind | None = None
    bad_input: bool = False


_HALT: Final = Condition("")
_CONFLICT = TransientKind.CONFLICT
_CONNECTION = TransientKind.CONNECTION

SQLSTATES: Final[Mapping[str, Condition]] = {
    # ---- classes
    "08": Condition("connection_exception", _CONNECTION),
    "22": Condition("data_exception", bad_input=True),  # bad values: the message's
    "40": Condition("transaction_rollback", _CONFLICT),  # serialization failure, deadlock, ...
    "53": Condition("insufficient_resources", TransientKind.RESOURCES),  # memory, disk, connections
    "54": Condition("program_limit_exceeded", bad_input=True),  # sizes, depth: the message's
    "57": Condition("operator_intervention", _CONNECTION),  # the backend was terminated, ...
    # ---- transient codes outside those classes
    "55P03": Condition("lock_not_available", _CONFLICT),  # lock_timeout, NOWAIT
    "57014": Condition("query_canceled", TransientKind.TIMEOUT),  # statement_timeout, a cancel
    # a prepared statement the server session does not match: behind a transaction pooler
    # (PgBouncer) each transaction may get another session (pginbox.pooler)
    "42P05": Condition("duplicate_prepared_statement", TransientKind.POOLER),
    "26000": Condition("invalid_sql_statement_name", TransientKind.POOLER),
    # ---- codes of class 22 and 54 the package raises (bad input)
    "22000": Condition("data_exception", bad_input=True),
    "22001": Condition("string_data_right_truncation", bad_input=True),
    "22004": Condition("null_value_not_allowed", bad_input=True),
    "22007": Condition("invalid_datetime_format", bad_input=True),
    "22008": Condition("datetime_field_overflow", bad_input=True),
    "22021": Condition("character_not_in_repertoire", bad_input=True),
    "22023": Condition("invalid_parameter_value", bad_input=True),
    "22P02": Condition("invalid_text_representation", bad_input=True),
    "54000": Condition("program_limit_exceeded", bad_input=True),
    "54001": Condition("statement_too_complex", bad_input=True),  # also a RecursionError's dead letter
    # ---- transient codes the package raises (named for messages)
    "40001": Condition("serialization_failure", _CONFLICT),
    "40P01": Condition("deadlock_detected", _CONFLICT),
    # ---- permanent: configuration, rights, state (the consumer halts on them)
    "23505": Condition("unique_violation"),
    "25000": Condition("invalid_transaction_state"),
    "25001": Condition("active_sql_transaction"),
    "25006": Condition("read_only_sql_transaction"),
    "25P02": Condition("in_failed_sql_transaction"),
    "3F000": Condition("invalid_schema_name"),
    "42501": Condition("insufficient_privilege"),
    "42704": Condition("undefined_object"),
    "42710": Condition("duplicate_object"),
    "42804": Condition("datatype_mismatch"),
    "42809": Condition("wrong_object_type"),
    "42883": Condition("undefined_function"),
    "42P01": Condition("undefined_table"),
    "55000": Condition("object_not_in_prerequisite_state"),
    "P0002": Condition("no_data_found"),
    "P0003": Condition("too_many_rows"),
    # ---- the package's own
    "IR001": Condition("replay_handler_changed"),
    "IR002": Condition("replay_pin_mismatch"),
    "IR003": Condition("replay_payload_mismatch"),
    "IRK01": Condition("kafka_partition_fenced"),  # the adapter acquires the partition again
}


def condition(sqlstate: str) -> Condition:
    """The entry of `sqlstate`, else of its class; a permanent, unnamed one when neither is known."""
    return SQLSTATES.get(sqlstate) or SQLSTATES.get(sqlstate[:2]) or _HALT
