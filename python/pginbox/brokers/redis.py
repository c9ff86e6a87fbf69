"""Redis Streams adapter (redis-py's asyncio client, extra `pginbox[redis]`): `RedisStreamsBroker`
for `pginbox consume`, `RedisStreamsTransport` (a BrokerDestination over `RedisStreamsPublisher`) for
the dispatcher.

An entry is a set of fields: the body in `body`, the identity in the Pginbox-* fields (the wire
contract's header names), and the effect's own headers. The entry id is a position in the stream,
never an identity: a message added again gets a new one.

Consuming (RedisStreamsBroker), with a consumer group (`durable`, default: the consumer name;
created at the stream's start, with the stream, when missing) and a consumer name of its own per
process:
  fetch        XREADGROUP ... > (new entries, COUNT prefetch, BLOCK); about once a second also
               XAUTOCLAIM: entries delivered to any consumer of the group and not acked for
               `claim_idle` seconds (a consumer that died) are taken over, marked redelivered
  ack          XACK after the COMMIT (one XACK for the acks of a batch)
  retry        one script: the entry's fields go into the sorted set `<stream>:retry` (score: when
               it is due, by the server's clock) and the entry is acked; the next fetch of any
               consumer moves due entries back to the stream as new entries (XADD), not marked
  dead letter  XADD to `<stream>:dead` with Pginbox-Sqlstate, Pginbox-Reason and
               Pginbox-Original (stream and entry id), and XACK, in one MULTI/EXEC
  hand back    XCLAIM ... IDLE: the entry stays pending and becomes due for XAUTOCLAIM after the
               pause (at most claim_idle)
  redelivery   an entry taken over with XAUTOCLAIM
The retry and move scripts touch the stream and its retry key: on Redis Cluster both must hash to
one slot (name the stream with a hash tag, `{orders}`: its retry key is then `{orders}:retry`).

Publishing (RedisStreamsPublisher): XADD of one entry per effect (Pginbox-Message-Id = the
idempotency key), a batch pipelined in one round trip, optionally trimmed (maxlen, approximate).
The reply (the entry id): delivered; an error reply: retryable; no reply (connection lost): ambiguous.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
import uuid
from collections.abc import Sequence
from typing import Any, cast

from pginbox.brokers.port import Delivery, Outgoing, SourceConfig
from pginbox.brokers.publish import BrokerDestination
from pginbox.brokers.wire import Header, dead_letter_headers, identity_headers
from pginbox.errors import BrokerError
from pginbox.runtime.log import safe_url
from pginbox.transports.protocol import DeliveryReport

try:
    import redis.asyncio as aioredis
    import redis.exceptions
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise BrokerError("Redis Streams support needs redis-py: pip install 'pginbox[redis]'") from exc

__all__ = ["RedisStreamsBroker", "RedisStreamsPublisher", "RedisStreamsTransport"]

_ERRORS = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    ConnectionError,
    OSError,
    asyncio.TimeoutError,
)

# KEYS: stream, retry set; ARGV: group, entry id, delay (ms), fields... -> acked count
_RETRY = """
local t = redis.call('TIME')
local due = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[3])
local fields = {}
for i = 4, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('ZADD', KEYS[2], due, cmsgpack.pack({ARGV[2], fields}))
return redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
"""
# KEYS: retry set, stream; ARGV: limit -> entries moved
_MOVE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, tonumber(ARGV[1]))
for _, member in ipairs(due) do
  local entry = cmsgpack.unpack(member)
  redis.call('XADD', KEYS[2], '*', unpack(entry[2]))
  redis.call('ZREM', KEYS[1], member)
end
return #due
"""


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class RedisStreamsBroker:
    name = "redis"

    def __init__(
        self, config: SourceConfig, *, connect_timeout: float = 5.0, maintenance_interval: float = 1.0
    ) -> None:
        if not config.stream:
            raise BrokerError("the Redis Streams adapter needs a stream")
        self.config = config
        self.stream = config.stream
        self.group = config.durable or config.consumer
        self.retry_key = str(config.options.get("retry_key") or f"{config.stream}:retry")
        self.member = str(
            config.options.get("consumer_name") or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        )
        self.connect_timeout = connect_timeout
        self.maintenance_interval = min(maintenance_interval, max(config.claim_idle / 4, 0.05))
        self._redis: aioredis.Redis | None = None
        self._next_maintenance = 0.0
        self._claim_cursor: str | bytes = "0-0"
        self._retry_script: Any = None
        self._move_script: Any = None

    def _client(self) -> aioredis.Redis:
        if self._redis is None:
            raise BrokerError(f"Redis {safe_url(self.config.url)}: not connected")
        return self._redis

    async def connect(self) -> None:
        await self.close()
        client = aioredis.from_url(
            self.config.url,
            socket_connect_timeout=self.connect_timeout,
            socket_keepalive=True,
            health_check_interval=30,
        )
        self._redis = client
        try:
            if self.config.declare:
                try:
                    await client.xgroup_create(self.stream, self.group, id="0", mkstream=True)
                except redis.exceptions.ResponseError as exc:
                    if "BUSYGROUP" not in str(exc):
                        raise
            else:
                await client.xinfo_groups(self.stream)  # raises when the stream is missing
            self._retry_script = client.register_script(_RETRY)
            self._move_script = client.register_script(_MOVE)
        except (*_ERRORS, redis.exceptions.RedisError) as exc:
            await self.close()
            raise BrokerError(
                f"Redis {safe_url(self.config.url)} stream {self.stream!r} group {self.group!r}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        self._next_maintenance = 0.0

    def _delivery(self, entry_id: Any, fields: dict[Any, Any], redelivered: bool) -> Delivery:
        headers = {_text(k): v for k, v in fields.items()}
        body = headers.pop(Header.BODY, b"")
        return Delivery(
            body if isinstance(body, bytes) else str(body).encode(),
            {"stream": self.stream},
            headers,
            redelivered,
            _text(entry_id),
        )

    async def fetch(self, max_messages: int, timeout: float) -> list[Delivery]:
        client = self._client()
        try:
            if time.monotonic() >= self._next_maintenance:
                self._next_maintenance = time.monotonic() + self.maintenance_interval
                await self._move_script(keys=[self.retry_key, self.stream], args=[1000])
                reply = await client.xautoclaim(
                    self.stream,
                    self.group,
                    self.member,
                    min_idle_time=int(self.config.claim_idle * 1000),
                    start_id=self._claim_cursor,
                    count=max_messages,
                )
                self._claim_cursor = reply[0]
                reclaimed = [self._delivery(i, f, True) for i, f in reply[1] if f is not None]
                if reclaimed:
                    return reclaimed
            read: Any = await client.xreadgroup(
                self.group, self.member, {self.stream: ">"}, count=max_messages, block=max(1, int(timeout * 1000))
            )
        except redis.exceptions.ResponseError as exc:
            if "NOGROUP" in str(exc):  # the stream or the group was deleted: declare again
                raise BrokerError(f"Redis stream {self.stream!r}: {exc}") from exc
            raise
        except _ERRORS as exc:
            raise BrokerError(f"Redis fetch failed: {type(exc).__name__}: {exc}") from exc
        out: list[Delivery] = []
        for _stream, entries in read or []:
            out.extend(self._delivery(i, f, False) for i, f in entries if f is not None)
        return out

    async def ack(self, delivery: Delivery) -> None:
        await self.ack_many([delivery])

    async def ack_many(self, deliveries: Sequence[Delivery]) -> None:
        if not deliveries:
            return
        try:
            await self._client().xack(self.stream, self.group, *(d.raw for d in deliveries))
        except _ERRORS as exc:
            raise BrokerError(f"Redis XACK failed: {exc}") from exc

    @staticmethod
    def _fields(delivery: Delivery, extra: dict[str, str] | None = None) -> list[Any]:
        flat: list[Any] = [Header.BODY, delivery.body]
        for key, value in {**delivery.headers, **(extra or {})}.items():
            flat.extend((key, value))
        return flat

    async def retry(self, delivery: Delivery, delay: float) -> None:
        try:
            await self._retry_script(
                keys=[self.stream, self.retry_key],
                args=[self.group, delivery.raw, max(1, round(delay * 1000)), *self._fields(delivery)],
            )
        except (*_ERRORS, redis.exceptions.RedisError) as exc:
            raise BrokerError(f"Redis retry through {self.retry_key!r} failed: {exc}") from exc

    async def dead_letter(self, delivery: Delivery, sqlstate: str, reason: str) -> None:
        target = self.config.dead_letter
        flat = self._fields(delivery, dead_letter_headers(sqlstate, reason, f"{self.stream} {delivery.raw}"))
        fields = dict(zip(flat[::2], flat[1::2], strict=True))
        try:
            async with self._client().pipeline(transaction=True) as pipe:
                pipe.xadd(target, fields)
                pipe.xack(self.stream, self.group, delivery.raw)
                await pipe.execute()
        except (*_ERRORS, redis.exceptions.RedisError) as exc:
            raise BrokerError(f"Redis dead letter to {target!r} failed: {exc}") from exc

    async def hand_back(self, delivery: Delivery, delay: float) -> None:
        idle = max(0, int((self.config.claim_idle - delay) * 1000))
        try:
            await self._client().xclaim(self.stream, self.group, self.member, 0, [delivery.raw], idle=idle, justid=True)
        except (*_ERRORS, redis.exceptions.RedisError) as exc:
            raise BrokerError(f"Redis XCLAIM failed: {exc}") from exc
        self._next_maintenance = min(self._next_maintenance, time.monotonic() + delay)

    async def close(self) -> None:
        client, self._redis = self._redis, None
        if client is None:
            return
        with contextlib.suppress(Exception):
            # a consumer name with nothing pending goes; one with pending entries stays, so that
            # XAUTOCLAIM can hand them to the others
            for info in await client.xinfo_consumers(self.stream, self.group):
                if _text(info.get("name")) == self.member and not info.get("pending"):
                    await client.xgroup_delconsumer(self.stream, self.group, self.member)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(client.aclose(), 5.0)


class RedisStreamsPublisher:
    name = "redis"
    confirm = "XADD reply"

    def __init__(self, url: str, *, stream: str, maxlen: int | None = None, timeout: float = 10.0) -> None:
        if not stream:
            raise ValueError("a Redis destination needs stream")
        self.url = url
        self.stream = stream
        self.maxlen = maxlen
        self.timeout = timeout
        self._redis: aioredis.Redis | None = None

    def _client(self) -> aioredis.Redis:
        if self._redis is None:
            self._redis = aioredis.from_url(
                self.url, socket_connect_timeout=min(self.timeout, 5.0), socket_timeout=self.timeout
            )
        return self._redis

    @staticmethod
    def fields(out: Outgoing) -> dict[str, Any]:
        return {Header.BODY: out.body, **identity_headers(out)}

    async def publish(self, messages: Sequence[Outgoing]) -> list[DeliveryReport]:
        try:
            async with self._client().pipeline(transaction=False) as pipe:
                for out in messages:
                    pipe.xadd(self.stream, cast(Any, self.fields(out)), maxlen=self.maxlen, approximate=True)
                replies = await pipe.execute(raise_on_error=False)
        except (*_ERRORS, redis.exceptions.RedisError) as exc:
            await self.close()
            return [DeliveryReport.failed(f"ambiguous: {type(exc).__name__}: {exc}", retryable=True) for _ in messages]
        return [
            DeliveryReport.failed(f"Redis refused the entry: {r}", retryable=True)
            if isinstance(r, Exception)
            else DeliveryReport.ok()
            for r in replies
        ]

    async def close(self) -> None:
        client, self._redis = self._redis, None
        if client is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(client.aclose(), 5.0)


class RedisStreamsTransport(BrokerDestination):
    """The dispatcher's Redis Streams destination (see the module docstring)."""

    def __init__(
        self,
        url: str,
        *,
        stream: str,
        producer: str = "pginbox",
        message_type: str | None = None,
        maxlen: int | None = None,
        timeout: float = 10.0,
        destination: str = "",
    ) -> None:
        self.url = url
        self.stream = stream
        super().__init__(
            RedisStreamsPublisher(url, stream=stream, maxlen=maxlen, timeout=timeout),
            producer=producer,
            message_type=message_type,
            timeout=timeout,
            destination=destination,
        )
