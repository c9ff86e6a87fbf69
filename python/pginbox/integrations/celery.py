"""Celery tasks that run through the inbox: `pip install pginbox[celery]`. Guide: docs/celery.md.

    @inbox_task(app, inbox=lambda: Inbox(psycopg.connect(DSN), consumer="billing"), name="billing.credit")
    def credit(cursor, message):          # runs in the transaction that holds the claim
        cursor.execute("UPDATE account SET ...", ...)

    credit.send({"account": 7, "cents": 250}, message_id="order-17", producer="shop")

The identity is the business id the caller gives `send` (Pginbox-* headers in the task's
kwargs, read with pginbox consume's code), never Celery's task id, which is new on every send.
What the broker is told, by outcome (docs/brokers.md, section 2):

  applied, duplicate, conflict,        ack (the task returns; the last three are logged with the
  quarantined, expired                 identity)
  failed (the handler raised)          Task.retry with a countdown doubling with the attempts
                                       (retry_delay ... max_retry_delay); quarantined, then acked,
                                       at the consumer's max_attempts
  bad input (no identity, body not     published to `<queue>.dead` with Pginbox-Sqlstate,
  JSON, class 22 / 54), and messages   Pginbox-Reason, Pginbox-Original, then acked; a dead letter
  Celery cannot decode or run          that cannot be published is not acked
  database unavailable                 never acked: a pause (growing, jittered), then rejected with
                                       requeue; not announced as a crash when it comes back here
  configuration or rights (42501,      never acked: logged with what to fix, a pause of
  42704, 42883, ...)                   halt_recheck seconds, then rejected with requeue

Celery's defaults would lose some of these: a late-acked task that raises is acked
(task_acks_on_failure_or_timeout), a retry whose publish fails is rejected without requeue, and a
message the worker cannot decode is acked and gone. InboxTask turns the first two off and
`inbox_task` installs a worker consumer (DeadLetteringConsumer) that dead-letters the third.
"""

from __future__ import annotations

import datetime
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, NoReturn, cast

import kombu
from celery import Celery, Task
from celery.concurrency.solo import TaskPool as SoloPool
from celery.exceptions import Reject, Retry
from celery.worker.consumer import Consumer as CeleryConsumer

from pginbox.brokers.port import Delivery
from pginbox.brokers.wire import MEMORY, Action, BadInput, Header, dead_letter_headers, parse_message
from pginbox.client.inbox import Handler, Inbox
from pginbox.client.outcomes import Message, Outcome, Result
from pginbox.consumer.core import retry_delay
from pginbox.integrations._framework import HandedBack, error_action, fix_hint, one_line, sources
from pginbox.runtime.backoff import jittered
from pginbox.runtime.log import kv

__all__ = ["DeadLetteringConsumer", "InboxTask", "configure", "dead_letter", "identity", "inbox_task"]

log = logging.getLogger("pginbox.celery")

#: The task keyword argument that carries the identity (the wire contract's Pginbox-* names).
IDENTITY_KWARG = "pginbox"
#: The Celery queue's dead letter: `pginbox consume` names RabbitMQ's the same way.
DEAD_SUFFIX = ".dead"

_SOURCES = sources(MEMORY)  # the Pginbox-* headers, read as `pginbox consume` reads them
_LOGGED = {
    Outcome.CONFLICT: "message_conflict",
    Outcome.QUARANTINED: "message_quarantined",
    Outcome.EXPIRED: "message_expired",
}


def identity(
    *,
    message_id: str,
    producer: str,
    message_type: str,
    tenant: str = "",
    produced_at: datetime.datetime | None = None,
) -> dict[str, str]:
    """The identity as the task's `pginbox` keyword argument (Pginbox-* names)."""
    headers = {
        Header.MESSAGE_ID: message_id,
        Header.PRODUCER: producer,
        Header.TYPE: message_type,
        Header.PRODUCED_AT: (produced_at or datetime.datetime.now(datetime.UTC)).isoformat(),
    }
    if tenant:
        headers[Header.TENANT] = tenant
    return headers


def _queue_of(delivery_info: Mapping[str, Any] | None) -> str:
    info = delivery_info or {}
    return str(info.get("routing_key") or info.get("queue") or "celery")


def dead_letter(
    app: Celery,
    queue: str,
    body: bytes,
    *,
    sqlstate: str,
    reason: str,
    origin: str,
    headers: Mapping[str, Any] | None = None,
    content_type: str = "application/json",
    content_encoding: str = "utf-8",
) -> str:
    """Publish `body` to `<queue>.dead` on the app's broker with the Pginbox-* dead-letter headers;
    returns the dead-letter queue's name. Raises when the broker did not take it (the caller then
    must not ack). On RabbitMQ, set broker_transport_options={"confirm_publish": True} so that
    "took it" means confirmed."""
    name = queue + DEAD_SUFFIX
    merged = {str(k): v for k, v in dict(headers or {}).items() if isinstance(v, str | int | float | bool)}
    merged.update(dead_letter_headers(sqlstate, reason, origin))
    target = kombu.Queue(name, exchange=kombu.Exchange(name, type="direct"), routing_key=name)
    with app.producer_or_acquire() as producer:
        producer.publish(
            body,
            exchange=target.exchange,
            routing_key=name,
            declare=[target],
            headers=merged,
            content_type=content_type,
            content_encoding=content_encoding,
            delivery_mode=2,
            retry=True,
            retry_policy={"max_retries": 3, "interval_start": 0.2, "interval_step": 0.5},
        )
    log.warning(kv("dead_letter", sqlstate=sqlstate, reason=reason[:300], origin=origin, target=name))
    return name


class InboxTask(Task):  # type: ignore[misc]  # celery is untyped
    """The base class of `inbox_task` tasks: late acks, never acked on an error it did not decide,
    requeued when its worker dies, no retry limit of Celery's own (the inbox's max_attempts is the
    limit)."""

    acks_late = True
    acks_on_failure_or_timeout = False
    acks_on_failure = False  # Celery >= 5.5 reads these two instead of the one above
    acks_on_timeout = False
    reject_on_worker_lost = True
    max_retries = None

    #: set by inbox_task
    pginbox_handler: Handler
    pginbox_inbox: Callable[[], Inbox]
    retry_delay: float = 1.0
    max_retry_delay: float = 300.0
    outage_pause: float = 10.0
    halt_recheck: float = 30.0
    dead_letter_queue: str | None = None

    _pginbox_lock = threading.Lock()

    def _inbox(self) -> Inbox:
        # Made on first use, in the worker process (after prefork's fork): one per task.
        made = cast(Inbox | None, self.__dict__.get("_pginbox_made"))
        if made is None:
            with self._pginbox_lock:
                made = cast(Inbox | None, self.__dict__.get("_pginbox_made"))
                if made is None:
                    made = self.pginbox_inbox()
                    self.__dict__["_pginbox_made"] = made
                    self.__dict__["_pginbox_handed_back"] = HandedBack()
                    self.__dict__["_pginbox_outages"] = 0
        return made

    def send(
        self,
        payload: Any,
        *,
        message_id: str,
        producer: str,
        message_type: str | None = None,
        tenant: str = "",
        produced_at: datetime.datetime | None = None,
        **options: Any,
    ) -> Any:
        """apply_async with the identity: `message_id` is the business id (the same on every send
        of the same message); the type defaults to the task's name. `options` go to
        apply_async (queue, countdown, ...)."""
        ident = identity(
            message_id=message_id,
            producer=producer,
            message_type=message_type or str(self.name),
            tenant=tenant,
            produced_at=produced_at,
        )
        return self.apply_async(args=(payload,), kwargs={IDENTITY_KWARG: ident}, **options)

    # ----------------------------------------------------------------- one delivery

    def _message(self, payload: Any, ident: Any) -> Message:
        if not isinstance(ident, Mapping):
            raise BadInput(
                "22004", f"the task has no {IDENTITY_KWARG}= identity: send it with task.send(payload, message_id=...)"
            )
        try:
            body = json.dumps(payload, separators=(",", ":"), allow_nan=False).encode()
        except (TypeError, ValueError) as exc:
            raise BadInput("22P02", f"the payload is not JSON: {str(exc)[:200]}") from None
        info = self.request.delivery_info or {}
        delivery = Delivery(
            body=body,
            properties={"queue": _queue_of(info)},
            headers=dict(ident),
            redelivered=bool(info.get("redelivered")),
        )
        return parse_message(delivery, _SOURCES)

    def _dead_letter(self, payload: Any, ident: Any, sqlstate: str, reason: str) -> dict[str, Any]:
        queue = self.dead_letter_queue or _queue_of(self.request.delivery_info)
        body = json.dumps(
            {"task": self.name, "id": self.request.id, "args": [payload], "kwargs": {IDENTITY_KWARG: ident}},
            default=repr,
        ).encode()
        try:
            target = dead_letter(
                self.app,
                queue,
                body,
                sqlstate=sqlstate,
                reason=reason,
                origin=f"{queue} task {self.name}[{self.request.id}]",
                headers=ident if isinstance(ident, Mapping) else None,
            )
        except Exception as exc:
            # Not stored: never acked (rule 5's "never dropped"); back after a pause.
            log.error(kv("dead_letter_failed", task=self.name, error=one_line(exc)))
            self._pause_and_requeue(None, self.outage_pause)
        return {"outcome": "dead_letter", "sqlstate": sqlstate, "reason": reason, "dead_letter": target}

    def _pause_and_requeue(self, message: Message | None, pause: float) -> NoReturn:
        self.__dict__["_pginbox_handed_back"].remember(message)
        time.sleep(pause)
        raise Reject(f"handed back after {pause:.3f}s", requeue=True)

    def _log(self, message: Message, result: Result) -> None:
        event = _LOGGED.get(result.outcome)
        if event is not None:
            log.warning(
                kv(
                    event,
                    consumer=self.__dict__["_pginbox_made"].consumer,
                    tenant=message.tenant,
                    producer=message.producer,
                    message_id=message.message_id,
                    message_type=message.message_type,
                    quarantine_id=result.quarantine_id,
                    reason=result.reason_code,
                )
            )

    def _deliver(self, payload: Any, ident: Any) -> dict[str, Any]:
        inbox = self._inbox()
        try:
            message = self.__dict__["_pginbox_handed_back"].announce(self._message(payload, ident))
        except BadInput as bad:
            return self._dead_letter(payload, ident, bad.sqlstate, bad.reason)
        try:
            result = inbox.handle(message, self.pginbox_handler, raise_on_failure=False)
        except Exception as exc:
            action = error_action(exc)
            if action is Action.DEAD_LETTER:
                state = getattr(exc, "sqlstate", None) or "22000"
                return self._dead_letter(payload, ident, state, one_line(exc))
            if action is Action.RETRY:
                self.__dict__["_pginbox_outages"] += 1
                pause = jittered(self.__dict__["_pginbox_outages"], 0.2, self.outage_pause)
                log.warning(
                    kv(
                        "database_unavailable",
                        consumer=inbox.consumer,
                        message_id=message.message_id,
                        pause=round(pause, 3),
                        error=one_line(exc),
                    )
                )
                self._pause_and_requeue(message, pause)
            log.error(
                kv(
                    "consumer_halted",
                    consumer=inbox.consumer,
                    sqlstate=getattr(exc, "sqlstate", None) or type(exc).__name__,
                    error=one_line(exc),
                    fix=fix_hint(exc),
                    producer=message.producer,
                    message_id=message.message_id,
                    recheck_in=self.halt_recheck,
                )
            )
            self._pause_and_requeue(message, self.halt_recheck)
        self.__dict__["_pginbox_outages"] = 0
        self._log(message, result)
        if result.outcome is Outcome.FAILED:
            countdown = retry_delay(result.attempts, self.retry_delay, self.max_retry_delay)
            log.info(
                kv(
                    "message_failed",
                    consumer=inbox.consumer,
                    message_id=message.message_id,
                    attempts=result.attempts,
                    reason=result.reason_code,
                    retry_in=countdown,
                )
            )
            try:
                raise self.retry(countdown=countdown, exc=result.exception)
            except Retry:
                raise
            except Reject:
                # Celery rejects WITHOUT requeue when the retry cannot be published: requeue.
                self._pause_and_requeue(None, self.outage_pause)
        return {
            "outcome": result.outcome.value,
            "message_id": message.message_id,
            "attempts": result.attempts,
            "quarantine_id": result.quarantine_id,
        }


def _run(self: InboxTask, payload: Any = None, pginbox: Any = None) -> dict[str, Any]:
    """Runs the handler through the inbox (InboxTask)."""
    try:
        return self._deliver(payload, pginbox)
    except (Retry, Reject):
        raise
    except Exception as exc:
        # Anything undecided (a bug here, the broker gone while dead-lettering): never acked.
        log.error(kv("task_error", task=self.name, error=one_line(exc)))
        raise Reject(exc, requeue=True) from exc


def configure(app: Celery) -> None:
    """Install DeadLetteringConsumer as the app's worker consumer (unless another one is set)."""
    current = app.conf.worker_consumer
    if current in (None, "celery.worker.consumer:Consumer"):
        app.conf.worker_consumer = "pginbox.integrations.celery:DeadLetteringConsumer"


def inbox_task(
    app: Celery,
    *,
    inbox: Callable[[], Inbox],
    name: str,
    retry_delay: float = 1.0,
    max_retry_delay: float = 300.0,
    outage_pause: float = 10.0,
    halt_recheck: float = 30.0,
    dead_letter_queue: str | None = None,
    **options: Any,
) -> Callable[[Handler], InboxTask]:
    """A Celery task (InboxTask) running `handler(cursor, message)` through `inbox().handle`.

    inbox            makes the task's Inbox, on first use in each worker process
    name             the task's name (and the default message type)
    retry_delay, max_retry_delay   the countdown of a failed message: doubling, capped
    outage_pause     cap of the pause before a message is handed back (database unavailable)
    halt_recheck     pause before a message refused by a configuration or rights error is handed back
    dead_letter_queue  the queue whose `.dead` receives bad input [default: the delivery's queue]
    options          other task options (queue, rate_limit, ...)
    """
    configure(app)

    def wrap(handler: Handler) -> InboxTask:
        task = app.task(
            base=InboxTask,
            bind=True,
            name=name,
            pginbox_handler=staticmethod(handler),
            pginbox_inbox=staticmethod(inbox),
            retry_delay=retry_delay,
            max_retry_delay=max_retry_delay,
            outage_pause=outage_pause,
            halt_recheck=halt_recheck,
            dead_letter_queue=dead_letter_queue,
            **options,
        )(_run)
        return cast(InboxTask, task)

    return wrap


class DeadLetteringConsumer(CeleryConsumer):  # type: ignore[misc]  # celery is untyped
    """Celery's worker consumer, except that a message it cannot decode, that names no known task
    or that is not a valid task message goes to `<queue>.dead` (Pginbox-Sqlstate, Pginbox-Reason)
    and is acked after that, instead of being acked and dropped (decode errors) or rejected
    without a dead-letter exchange (unknown and invalid tasks). Not stored: requeued.

    Under `-P solo` it also sends a task's ack (or reject) when the task ends, instead of queueing
    it on kombu's event loop: a solo task runs inside the loop's socket reader, which kombu calls
    after it has taken its queued callbacks and before it polls again, so the queued ack waited
    for the poll's timeout (10 s) whenever no other frame arrived - always once every prefetched
    message was done and waiting for its ack (celery 5.7 / kombu 5.7)."""

    def call_soon_ack(self, p: Any, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(self.pool, SoloPool):
            return super().call_soon_ack(p, *args, **kwargs)
        # The solo pool runs every task on the loop's thread: writing the frame now is what
        # Celery does without a hub, and nothing else uses the connection meanwhile.
        try:
            p(*args, **kwargs)
        except Exception as exc:
            log.error(kv("ack_failed", error=one_line(exc)))
        return p

    def _pginbox_dead_letter(self, message: Any, sqlstate: str, reason: str) -> None:
        queue = _queue_of(getattr(message, "delivery_info", None))
        try:
            dead_letter(
                self.app,
                queue,
                bytes(message.body) if not isinstance(message.body, str) else message.body.encode(),
                sqlstate=sqlstate,
                reason=reason,
                origin=queue,
                headers=message.headers,
                content_type=message.content_type or "application/octet-stream",
                content_encoding=message.content_encoding or "binary",
            )
        except Exception as exc:
            log.error(kv("dead_letter_failed", queue=queue, sqlstate=sqlstate, error=one_line(exc)))
            time.sleep(1.0)
            message.reject(requeue=True)
            return
        message.ack()

    def on_decode_error(self, message: Any, exc: BaseException) -> None:
        self._pginbox_dead_letter(message, "22P02", f"Celery could not decode the message: {one_line(exc)}")

    def on_unknown_message(self, body: Any, message: Any) -> None:
        self._pginbox_dead_letter(message, "22P02", "not a Celery task message (no task header)")

    def on_unknown_task(self, body: Any, message: Any, exc: BaseException) -> None:
        task = (message.headers or {}).get("task")
        self._pginbox_dead_letter(message, "42704", f"no task named {task!r} is registered in this worker")

    def on_invalid_task(self, body: Any, message: Any, exc: BaseException) -> None:
        self._pginbox_dead_letter(message, "22023", f"invalid task message: {one_line(exc)}")
