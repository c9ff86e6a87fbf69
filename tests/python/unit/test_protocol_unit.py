"""The transaction protocol (pginbox.client.protocol) without a database: its operations are
answered here, as the clients' drivers answer them with I/O. What the protocol decides — retry,
back-off, a lost COMMIT resolved with pg_xact_status, the handler's rules — is checked step by step.
Behaviour on a real database: test_library.py, test_sqlalchemy*.py, test_django.py, test_crash.py."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import random
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from psycopg import errors as pg_errors

from pginbox import Message, Outcome, Result, RetryPolicy, TransientKind
from pginbox.client.drive import drive, drive_async
from pginbox.client.protocol import (
    Call,
    CommitUnknown,
    Protocol,
    Sleep,
    Steps,
    Transient,
    commit_lost,
    judge_handler,
    raise_if_failed,
)
from pginbox.client.retry import classify
from pginbox.client.shared import CallCost, Failure, StatsCounter
from pginbox.errors import CommitOutcomeUnknown, HandlerProtocolError, RetriesExhausted

MESSAGE = Message("shop", "m-1", "credit", {"amount": 1})
APPLIED = Result(Outcome.APPLIED, "sha")


def protocol(
    policy: RetryPolicy | None = None,
    *,
    statuses: list[str | None] | None = None,
    stats: StatsCounter | None = None,
    terminated: list[tuple[int, str]] | None = None,
) -> Protocol:
    answers = list(statuses or [])

    def poll(xid: str) -> str | None:
        return answers.pop(0)

    def terminate(pid: int, xid: str) -> None:
        assert terminated is not None
        terminated.append((pid, xid))

    return Protocol(
        policy or RetryPolicy(base_delay=0.01, max_delay=0.05),
        classify=classify,
        poll_status=poll,
        terminate=terminate if terminated is not None else None,
        stats=stats,
        rng=random.Random(7),
    )


def run(steps: Steps[Any]) -> tuple[Any, list[Any]]:
    """Drive `steps` by hand: Calls are called, Sleeps recorded (not slept); (value, ops)."""
    ops: list[Any] = []
    send: Any = None
    error: BaseException | None = None
    while True:
        try:
            op = steps.send(send) if error is None else steps.throw(error)
        except StopIteration as stop:
            return stop.value, ops
        ops.append(op)
        send, error = None, None
        if isinstance(op, Call):
            try:
                send = op.fn()
            except Exception as exc:
                error = exc


def attempts(*outcomes: Any) -> Callable[[], Any]:
    """An attempt that raises or returns the given outcomes in turn."""
    queue = list(outcomes)

    def attempt() -> Any:
        outcome = queue.pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    return attempt


def serialization_failure() -> psycopg.Error:
    return pg_errors.SerializationFailure("could not serialize access")


def test_a_transient_error_runs_the_attempt_again_after_a_jittered_backoff() -> None:
    cost = CallCost()
    stats = StatsCounter()
    value, ops = run(protocol(stats=stats).retry(attempts(serialization_failure(), APPLIED), cost))
    assert value == APPLIED
    sleeps = [op for op in ops if isinstance(op, Sleep)]
    assert len(sleeps) == 1 and 0.0 <= sleeps[0].seconds <= 0.01
    assert cost.retries == 1 and cost.backoff == sleeps[0].seconds
    assert stats.snapshot().transient_errors == {"40001": 1}


def test_the_backoff_cap_doubles_up_to_max_delay() -> None:
    policy = RetryPolicy(base_delay=0.01, max_delay=0.03)
    rng = random.Random(1)
    caps = [max(policy.backoff(n, rng) for _ in range(300)) for n in (1, 2, 3, 4)]
    assert caps[0] <= 0.01 < caps[1] <= 0.02 < caps[2] <= 0.03 and caps[3] <= 0.03


def test_a_permanent_error_is_raised_at_once() -> None:
    error = pg_errors.UniqueViolation("duplicate key")
    with pytest.raises(pg_errors.UniqueViolation):
        run(protocol().retry(attempts(error), CallCost()))


def test_retries_end_in_retries_exhausted_with_the_last_error() -> None:
    stats = StatsCounter()
    errors = [serialization_failure() for _ in range(3)]
    with pytest.raises(RetriesExhausted) as raised:
        run(protocol(RetryPolicy(max_attempts=3), stats=stats).retry(attempts(*errors), CallCost()))
    assert raised.value.attempts == 3 and raised.value.sqlstate == "40001"
    assert raised.value.__cause__ is errors[-1]
    assert stats.snapshot().retries_exhausted == 1


def test_a_transient_signal_carries_its_kind() -> None:
    lost = psycopg.OperationalError("server closed the connection")
    value, ops = run(protocol().retry(attempts(Transient(TransientKind.CONNECTION, lost), 42), CallCost()))
    assert value == 42 and sum(isinstance(op, Sleep) for op in ops) == 1


def test_a_pooler_error_stops_preparing() -> None:
    found: list[bool] = []
    p = protocol()
    p.on_pooler = lambda: found.append(True)
    error = pg_errors.lookup("26000")("prepared statement does not exist")
    value, _ = run(p.retry(attempts(error, "ok"), CallCost()))
    assert value == "ok" and found == [True]


def test_a_lost_commit_that_committed_returns_the_attempts_value() -> None:
    stats = StatsCounter()
    lost = CommitUnknown("1234", None, APPLIED, psycopg.OperationalError("gone"))
    value, ops = run(protocol(statuses=["in progress", "committed"], stats=stats).retry(attempts(lost), CallCost()))
    assert value == APPLIED
    assert [type(op) for op in ops] == [Call, Call, Sleep, Call]  # attempt, poll, wait, poll
    assert stats.snapshot().unknown_commits == 1 and stats.snapshot().unknown_committed == 1


def test_a_lost_commit_that_aborted_runs_the_attempt_again() -> None:
    lost = CommitUnknown("1234", None, APPLIED, psycopg.OperationalError("gone"))
    again = Result(Outcome.DUPLICATE)
    value, _ = run(protocol(statuses=["aborted"]).retry(attempts(lost, again), CallCost()))
    assert value == again


def test_a_lost_commit_nobody_can_tell_raises_commit_outcome_unknown() -> None:
    lost = CommitUnknown("1234", None, APPLIED, psycopg.OperationalError("gone"))
    with pytest.raises(CommitOutcomeUnknown) as raised:
        run(protocol(statuses=[None]).retry(attempts(lost), CallCost()))
    assert raised.value.xid == "1234"


def test_a_lost_commit_times_out_after_resolve_timeout() -> None:
    lost = CommitUnknown("1234", None, APPLIED, psycopg.OperationalError("gone"))
    policy = RetryPolicy(resolve_timeout=0.0)
    with pytest.raises(CommitOutcomeUnknown, match="last status: in progress"):
        run(protocol(policy, statuses=["in progress"]).retry(attempts(lost), CallCost()))


def test_an_orphaned_backend_is_terminated_after_the_grace() -> None:
    terminated: list[tuple[int, str]] = []
    lost = CommitUnknown("1234", 777, APPLIED, psycopg.OperationalError("gone"))
    policy = RetryPolicy(orphan_grace=0.0)
    value, _ = run(
        protocol(policy, statuses=["in progress", "aborted"], terminated=terminated).retry(
            attempts(lost, "again"), CallCost()
        )
    )
    assert value == "again" and terminated == [(777, "1234")]


def test_an_unreachable_database_while_resolving_is_polled_again() -> None:
    lost = CommitUnknown("1234", None, APPLIED, psycopg.OperationalError("gone"))
    answers: list[Any] = [psycopg.OperationalError("still gone"), "committed"]

    def poll(xid: str) -> str:
        answer = answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return str(answer)

    p = Protocol(RetryPolicy(), classify=classify, poll_status=poll)
    value, _ = run(p.retry(attempts(lost), CallCost()))
    assert value == APPLIED


def test_a_commit_lost_without_a_transaction_id_changed_nothing() -> None:
    assert commit_lost(None, 1, "value", psycopg.OperationalError("gone")) == "value"
    with pytest.raises(CommitUnknown):
        commit_lost("99", 1, "value", psycopg.OperationalError("gone"))


def test_handle_records_a_handler_failure_and_stamps_its_exception() -> None:
    error = ValueError("bad amount")
    recorded = Result(Outcome.FAILED, attempts=1, reason_code="ValueError")
    seen: list[BaseException] = []

    def record(exc: BaseException) -> Callable[[], Result]:
        seen.append(exc)
        return lambda: recorded

    stats = StatsCounter()
    value, _ = run(
        protocol(stats=stats).handle(
            MESSAGE, start=None, attempt=attempts(Failure(error, APPLIED)), record_failure=record
        )
    )
    assert value.outcome is Outcome.FAILED and value.exception is error and seen == [error]
    assert stats.snapshot().outcomes == {Outcome.FAILED: 1}
    with pytest.raises(ValueError) as raised:
        raise_if_failed(value, MESSAGE, True)
    assert "recorded as failed (attempt 1, reason 'ValueError') for message 'm-1'" in raised.value.__notes__[0]
    assert raise_if_failed(value, MESSAGE, False) is value


def test_handle_announces_a_redelivery_and_stops_at_quarantine() -> None:
    held = Result(Outcome.QUARANTINED, quarantine_id=5)
    redelivered = Message("shop", "m-1", "credit", {}, redelivered=True)
    value, ops = run(
        protocol().handle(redelivered, start=lambda: held, attempt=attempts(), record_failure=lambda e: attempts())
    )
    assert value == held and len(ops) == 1
    value, ops = run(
        protocol().handle(
            redelivered, start=lambda: None, attempt=attempts(APPLIED), record_failure=lambda e: attempts()
        )
    )
    assert value == APPLIED and len(ops) == 2


def test_handle_stamps_the_retries_of_the_call() -> None:
    value, _ = run(
        protocol().handle(
            MESSAGE, start=None, attempt=attempts(serialization_failure(), APPLIED), record_failure=lambda e: attempts()
        )
    )
    assert value.outcome is Outcome.APPLIED and value.retries == 1 and value.lock_wait_seconds >= 0.0


# ----------------------------------------------------------------------------- the handler's rules


def judge(error: Exception | None = None, returned: object = None, **state: Any) -> Any:
    flags = {"transient": None, "lost": False, "failed_tx": False, "ended_tx": False, **state}
    return judge_handler(error, returned, client="Inbox", **flags)


def test_a_handler_that_returned_commits() -> None:
    assert judge() is None
    assert judge(returned=42) is None


def test_a_handler_error_is_recorded_unless_transient() -> None:
    error = ValueError("bad")
    assert judge(error) is error
    verdict = judge(error, transient=TransientKind.CONFLICT)
    assert isinstance(verdict, Transient) and verdict.kind is TransientKind.CONFLICT and verdict.error is error
    verdict = judge(error, lost=True)
    assert isinstance(verdict, Transient) and verdict.kind is TransientKind.CONNECTION


def test_a_handler_that_returned_a_coroutine_fails() -> None:
    async def forgotten() -> None:
        pass

    coroutine = forgotten()
    verdict = judge(returned=coroutine)
    assert isinstance(verdict, HandlerProtocolError) and verdict.reason_code == "handler_returned_awaitable"
    assert inspect.getcoroutinestate(coroutine) == "CORO_CLOSED"  # no "never awaited" warning


def test_a_handler_that_left_its_transaction_failed_fails_with_25p02() -> None:
    verdict = judge(failed_tx=True)
    assert isinstance(verdict, HandlerProtocolError) and verdict.sqlstate == "25P02"
    assert isinstance(judge(lost=True), Transient)


def test_a_handler_that_ended_the_transaction_is_refused() -> None:
    with pytest.raises(HandlerProtocolError, match="Inbox commits it when the handler returns"):
        judge(ended_tx=True)


# ----------------------------------------------------------------------------- the drivers


def test_both_drivers_run_the_same_steps() -> None:
    def steps() -> Steps[int]:
        first = yield Call(lambda: 20)
        yield Sleep(0.0)
        with contextlib.suppress(KeyError):
            yield Call(attempts(KeyError("x")))
        return int(first) + 22

    async def awaited() -> int:
        return 20

    def async_steps() -> Steps[int]:
        first = yield Call(awaited)
        yield Sleep(0.0)
        return int(first) + 22

    assert drive(steps()) == 42
    assert asyncio.run(drive_async(steps())) == 42
    assert asyncio.run(drive_async(async_steps())) == 42


@pytest.mark.parametrize(
    ("host", "hostaddr", "local"),
    [
        ("/var/run/postgresql", "", True),
        ("", "", True),
        ("127.0.0.1", "127.0.0.1", True),
        ("localhost", "::1", True),
        ("localhost", "", True),
        ("db.internal", "10.1.2.3", False),
        ("10.1.2.3", "10.1.2.3", False),
        ("db.internal", "", False),
    ],
)
def test_the_pipeline_is_used_only_for_a_server_on_another_machine(host: str, hostaddr: str, local: bool) -> None:
    from pginbox.client.shared import is_local_server

    assert is_local_server(host, hostaddr) is local
