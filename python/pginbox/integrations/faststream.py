"""FastStream subscribers that run through the inbox: `pip install pginbox[faststream]`
(FastStream >= 0.6: manual acknowledgement is `AckPolicy.MANUAL`). Guide: docs/faststream.md.

    broker = RabbitBroker(URL)

    @inbox_subscriber(broker, "orders", url=URL, inbox=make_inbox)
    async def credit(cursor, message):        # runs in the transaction that holds the claim
        await cursor.execute("UPDATE account SET ...", ...)

`inbox_subscriber` registers a subscriber with manual acknowledgement and a decoder that does not
parse the body (FastStream would otherwise decode it before any handler runs, and a malformed
body would stay unacked, holding a prefetch slot). The subscriber then does what `pginbox consume`
does with one delivery, with the same code: the identity is read from the message with the same
sources (`identity=`, the [consume] table's producer=, message_id=, ... settings), the message is
claimed and handled in one transaction (AsyncInbox.handle), and the broker is told through the
same adapters (pginbox.brokers), after the COMMIT:

  applied, duplicate, conflict,    ack (the last three logged with the identity)
  quarantined, expired
  failed                           back after retry_delay x 2^(attempt - 1), capped
                                   (RabbitMQ: <queue>.retry.<ms>; NATS: NAK with the delay;
                                   Redis: <stream>:retry), quarantined at max_attempts
  bad input (no identity, body     to the dead letter with Pginbox-Sqlstate / Pginbox-Reason, then
  not JSON, class 22 / 54)         acked (RabbitMQ <queue>.dead, NATS pginbox.dead.<durable>,
                                   Redis <stream>:dead)
  database unavailable             handed back after a pause, not announced as a crash here
  configuration or rights          logged with what to fix, handed back after halt_recheck

Brokers: RabbitMQ (RabbitBroker), NATS JetStream (NatsBroker with `stream=`; a push or pull
subscriber), Redis Streams (RedisBroker with `stream=StreamSub(name, group=..., consumer=...)`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from faststream import AckPolicy, Context

from pginbox.brokers.port import Broker, Delivery, SourceConfig
from pginbox.brokers.wire import NATS, RABBITMQ, REDIS, Action, BadInput, parse_message
from pginbox.client.async_inbox import AsyncHandler, AsyncInbox
from pginbox.client.outcomes import Message, Outcome, Result
from pginbox.consumer.core import retry_delay
from pginbox.integrations._framework import HandedBack, error_action, fix_hint, one_line, sources
from pginbox.runtime.backoff import jittered
from pginbox.runtime.log import kv

__all__ = ["InboxSubscription", "close", "inbox_subscriber", "subscriptions"]

log = logging.getLogger("pginbox.faststream")

_LOGGED = {
    Outcome.CONFLICT: "message_conflict",
    Outcome.QUARANTINED: "message_quarantined",
    Outcome.EXPIRED: "message_expired",
}

InboxFactory = Callable[[], Awaitable[AsyncInbox]]
#: Redis: the field of an entry added again for a dead consumer (the copy is a redelivery)
REDELIVERED = "Pginbox-Redelivered"


def kind_of(broker: Any) -> str:
    """rabbitmq, nats or redis, from the FastStream broker's class."""
    name = type(broker).__module__
    for kind, module in ((RABBITMQ, "faststream.rabbit"), (NATS, "faststream.nats"), (REDIS, "faststream.redis")):
        if name.startswith(module):
            return kind
    raise TypeError(f"inbox_subscriber supports RabbitBroker, NatsBroker and RedisBroker, not {type(broker).__name__}")


def _name(value: Any) -> str | None:
    if value is None:
        return None
    return str(getattr(value, "name", value))


async def _raw_body(msg: Any) -> Any:
    """The decoder: the body as it came (bytes); parsing it is pginbox's (bad input is dead-lettered)."""
    return msg.body


@dataclass
class InboxSubscription:
    """One subscriber's state: where it reads, its identity sources, its adapter (opened on the
    first message, in the app's event loop) and its Inbox."""

    kind: str
    url: str
    config: SourceConfig
    inbox_source: AsyncInbox | InboxFactory
    handler: AsyncHandler
    identity: Mapping[str, str] | None = None
    retry_delay: float = 1.0
    max_retry_delay: float = 300.0
    outage_pause: float = 10.0
    halt_recheck: float = 30.0
    handed_back: HandedBack = field(default_factory=HandedBack)
    outages: int = 0
    adapter: Any = None
    inbox: AsyncInbox | None = None
    _maintenance: asyncio.Task[None] | None = None
    _lock: asyncio.Lock | None = None

    def __post_init__(self) -> None:
        self.sources = sources(self.kind, self.identity)

    async def _open(self) -> tuple[Any, AsyncInbox]:
        if self.adapter is not None and self.inbox is not None:
            return self.adapter, self.inbox
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self.inbox is None:
                given = self.inbox_source
                self.inbox = given if isinstance(given, AsyncInbox) else await given()
            if self.adapter is None:
                self.adapter = await self._adapter()
        return self.adapter, self.inbox

    async def _adapter(self) -> Broker:
        """pginbox consume's adapter for the broker, on a connection of its own, used for its
        settlements only (FastStream consumes)."""
        if self.kind == RABBITMQ:
            import aio_pika

            from pginbox.brokers.rabbitmq import RabbitMQBroker

            rabbit = RabbitMQBroker(self.config)
            rabbit._connection = await aio_pika.connect(self.url)
            rabbit._channel = await rabbit._connection.channel(publisher_confirms=True)
            return rabbit
        if self.kind == NATS:
            from pginbox.brokers.jetstream import JetStreamBroker, connect_nats

            jet = JetStreamBroker(self.config)
            jet._nc = await connect_nats(self.url)
            return jet
        from pginbox.brokers.redis import RedisStreamsBroker

        red = RedisStreamsBroker(self.config)
        await red.connect()  # its own client, the group if missing, the retry scripts
        self._maintenance = asyncio.get_running_loop().create_task(self._move_due(red))
        return red

    async def _move_due(self, red: Any) -> None:
        """Redis, every 0.2 s: failed entries whose delay is over go back into the stream (what
        the adapter's fetch does for `pginbox consume`), and entries a dead consumer left pending
        longer than claim_idle are added again, marked redelivered (FastStream reads only new
        entries: without this they would stay pending for ever)."""
        while True:
            with contextlib.suppress(Exception):
                await red._move_script(keys=[red.retry_key, red.stream], args=[1000])
                reply = await red._client().xautoclaim(
                    red.stream,
                    red.group,
                    red.member,
                    min_idle_time=int(red.config.claim_idle * 1000),
                    start_id="0-0",
                    count=100,
                )
                for entry_id, fields in reply[1]:
                    if fields is None:
                        continue
                    async with red._client().pipeline(transaction=True) as pipe:
                        pipe.xadd(red.stream, {**fields, REDELIVERED: "1"})
                        pipe.xack(red.stream, red.group, entry_id)
                        await pipe.execute()
            await asyncio.sleep(0.2)

    async def close(self) -> None:
        """Close the adapter's connection (the Inbox is the caller's)."""
        if self._maintenance is not None:
            self._maintenance.cancel()
            self._maintenance = None
        adapter, self.adapter = self.adapter, None
        if adapter is None:
            return
        with contextlib.suppress(Exception):
            if self.kind == NATS:
                await adapter._nc.close()
            elif self.kind == RABBITMQ:
                await adapter.close()
                await adapter._connection.close()
            else:
                await adapter.close()

    def delivery(self, adapter: Any, raw: Any) -> Delivery:
        """The FastStream message's raw broker message as the port's Delivery (the adapter's own
        reading of properties, headers and the redelivery mark)."""
        if self.kind == REDIS:
            entry_id = raw["message_ids"][0]
            fields = dict(raw["data"])
            marked = fields.pop(REDELIVERED.encode(), None) or fields.pop(REDELIVERED, None)
            counts = raw.get("delivery_counts")
            made: Delivery = adapter._delivery(entry_id, fields, bool(marked) or bool(counts and counts[0] > 0))
            return made
        made = type(adapter)._delivery(raw)
        return made

    async def __call__(self, raw: Any) -> None:
        adapter, inbox = await self._open()
        delivery = self.delivery(adapter, raw)
        try:
            delivery.message = self.handed_back.announce(parse_message(delivery, self.sources))
        except BadInput as bad:
            await self._dead_letter(adapter, delivery, bad.sqlstate, bad.reason)
            return
        message = delivery.message
        try:
            result = await inbox.handle(message, self.handler, raise_on_failure=False)
        except Exception as exc:
            await self._undecided(adapter, inbox, delivery, message, exc)
            return
        self.outages = 0
        self._log(inbox, message, result)
        if result.ack:
            await adapter.ack(delivery)
            return
        delay = retry_delay(result.attempts, self.retry_delay, self.max_retry_delay)
        log.info(
            kv(
                "message_failed",
                consumer=inbox.consumer,
                message_id=message.message_id,
                attempts=result.attempts,
                reason=result.reason_code,
                retry_in=delay,
            )
        )
        await adapter.retry(delivery, delay)

    async def _undecided(
        self, adapter: Any, inbox: AsyncInbox, delivery: Delivery, message: Message, exc: Exception
    ) -> None:
        action = error_action(exc)
        if action is Action.DEAD_LETTER:
            await self._dead_letter(adapter, delivery, getattr(exc, "sqlstate", None) or "22000", one_line(exc))
            return
        if action is Action.RETRY:
            self.outages += 1
            pause = jittered(self.outages, 0.2, self.outage_pause, random.Random())
            log.warning(
                kv(
                    "database_unavailable",
                    consumer=inbox.consumer,
                    message_id=message.message_id,
                    pause=round(pause, 3),
                    error=one_line(exc),
                )
            )
        else:
            pause = self.halt_recheck
            log.error(
                kv(
                    "consumer_halted",
                    consumer=inbox.consumer,
                    sqlstate=getattr(exc, "sqlstate", None) or type(exc).__name__,
                    error=one_line(exc),
                    fix=fix_hint(exc),
                    producer=message.producer,
                    message_id=message.message_id,
                    recheck_in=pause,
                )
            )
        self.handed_back.remember(message)
        # The pause holds this subscriber's slot (the consumer's pause before it fetches again);
        # RabbitMQ requeues at once, so the pause comes first.
        await asyncio.sleep(pause)
        if self.kind == REDIS:
            # FastStream reads only new entries (XREADGROUP >): one left pending would never come
            # back; the retry set brings it back (ZADD + XACK in one script, nothing lost).
            await adapter.retry(delivery, pause)
        else:
            await adapter.hand_back(delivery, pause)

    async def _dead_letter(self, adapter: Any, delivery: Delivery, sqlstate: str, reason: str) -> None:
        log.warning(
            kv(
                "dead_letter",
                consumer=self.config.consumer,
                sqlstate=sqlstate,
                reason=reason[:300],
                target=self.config.dead_letter,
            )
        )
        await adapter.dead_letter(delivery, sqlstate, reason[:1000])

    def _log(self, inbox: AsyncInbox, message: Message, result: Result) -> None:
        event = _LOGGED.get(result.outcome)
        if event is not None:
            log.warning(
                kv(
                    event,
                    consumer=inbox.consumer,
                    tenant=message.tenant,
                    producer=message.producer,
                    message_id=message.message_id,
                    message_type=message.message_type,
                    quarantine_id=result.quarantine_id,
                    reason=result.reason_code,
                )
            )


#: FastStream injects the message (StreamMessage) into the parameter with this default
_MESSAGE: Any = Context("message")

#: id(broker) -> (broker, its inbox subscriptions)
_SUBSCRIPTIONS: dict[int, tuple[Any, list[InboxSubscription]]] = {}


def subscriptions(broker: Any) -> list[InboxSubscription]:
    """The inbox subscriptions registered on `broker`."""
    return list(_SUBSCRIPTIONS.get(id(broker), (broker, []))[1])


async def close(broker: Any) -> None:
    """Close the settlement connections of `broker`'s inbox subscriptions (after broker.stop();
    the Inboxes are the caller's)."""
    for subscription in subscriptions(broker):
        await subscription.close()


def inbox_subscriber(
    broker: Any,
    *args: Any,
    url: str,
    inbox: AsyncInbox | InboxFactory,
    consumer: str | None = None,
    identity: Mapping[str, str] | None = None,
    dead_letter: str | None = None,
    retry_delay: float = 1.0,
    max_retry_delay: float = 300.0,
    outage_pause: float = 10.0,
    halt_recheck: float = 30.0,
    claim_idle: float = 30.0,
    **subscriber_options: Any,
) -> Callable[[AsyncHandler], Any]:
    """Register `handler(cursor, message)` (async, AsyncInbox.handle's handler) as a FastStream
    subscriber of `broker` that runs through the inbox.

    args, subscriber_options  what broker.subscriber takes (the queue; subject and stream=;
                     stream=StreamSub(...)); ack_policy and decoder are set here
    url              the broker's URL: the settlements (retry queue, dead letter) use a
                     connection of their own
    inbox            an AsyncInbox, or an async function that makes one (called on the first
                     message, in the app's event loop)
    identity         where each identity field is read (producer=, message_id=, ... as in the
                     [consume] table) [default: pginbox consume's defaults for the broker]
    dead_letter      RabbitMQ queue, NATS subject (a stream must capture it) or Redis stream
                     [default: <queue>.dead, pginbox.dead.<durable>, <stream>:dead]
    claim_idle       Redis: seconds an entry may stay pending (its consumer died) before it is
                     added again, marked redelivered
    Returns the decorator (it returns what broker.subscriber returns). `subscriptions(broker)`
    lists the InboxSubscriptions; `await close(broker)` closes their connections (app shutdown)."""
    kind = kind_of(broker)
    options = dict(subscriber_options)
    if kind == RABBITMQ:
        queue = _name(args[0] if args else options.get("queue"))
        if not queue:
            raise TypeError("inbox_subscriber(RabbitBroker, QUEUE, ...): the queue is required")
        config = SourceConfig(RABBITMQ, url, consumer or "", dead_letter or f"{queue}.dead", queue=queue)
    elif kind == NATS:
        subject = str(args[0] if args else options.get("subject"))
        stream = _name(options.get("stream"))
        durable = _name(options.get("durable"))
        if not stream or not durable:
            raise TypeError("inbox_subscriber(NatsBroker, SUBJECT, stream=..., durable=...): JetStream is required")
        config = SourceConfig(
            NATS,
            url,
            consumer or "",
            dead_letter or f"pginbox.dead.{durable}",
            stream=stream,
            subject=subject,
            durable=durable,
        )
    else:
        sub = options.get("stream")
        stream = _name(sub)
        group = getattr(sub, "group", None)
        if not stream or not group:
            raise TypeError(
                "inbox_subscriber(RedisBroker, stream=StreamSub(NAME, group=..., consumer=...)) is required"
            )
        config = SourceConfig(
            REDIS,
            url,
            consumer or "",
            dead_letter or f"{stream}:dead",
            stream=stream,
            durable=group,
            claim_idle=claim_idle,
        )
    options["ack_policy"] = AckPolicy.MANUAL
    options["decoder"] = _raw_body

    def wrap(handler: AsyncHandler) -> Any:
        subscription = InboxSubscription(
            kind,
            url,
            config,
            inbox,
            handler,
            identity=identity,
            retry_delay=retry_delay,
            max_retry_delay=max_retry_delay,
            outage_pause=outage_pause,
            halt_recheck=halt_recheck,
        )

        async def consume(body: Any, msg: Any = _MESSAGE) -> None:
            await subscription(msg.raw_message)

        # the handler's names, not its signature: FastStream reads consume's (body, message)
        consume.__name__ = getattr(handler, "__name__", "inbox_handler")
        consume.__qualname__ = getattr(handler, "__qualname__", consume.__name__)
        consume.__doc__ = handler.__doc__
        registered = broker.subscriber(*args, **options)(consume)
        _SUBSCRIPTIONS.setdefault(id(broker), (broker, []))[1].append(subscription)
        return registered

    return wrap
