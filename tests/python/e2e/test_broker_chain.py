"""Two services chained through a broker, under crashes (issue 13, item 3).

Service A commits a domain change and its effect in one transaction (some transactions roll
back); `pginbox dispatch` publishes the effects to the broker (RabbitMQ queue / JetStream stream /
Redis stream);
service B runs `pginbox consume` into a second database, whose SQL handler records the order and
enqueues a follow-up effect. Every client reaches the broker through a TCP proxy. While it runs:
SIGKILL of the dispatcher, SIGKILL of the consumer mid-batch, connections cut at the proxy, and
a broker restart: a private `nats-server -js` with its own store directory, a private
`redis-server` whose append-only file is fsynced at every write, or a private RabbitMQ
node on other ports with its own Mnesia directory (started as the rabbitmq user, ~7 s), SIGKILLed
and started again. When a private RabbitMQ node cannot be started (not root, no rabbitmq user, too
slow), the RabbitMQ run uses the shared broker with connection cuts only, and says so.

Then: every effect committed at A is applied exactly once at B with exactly one follow-up
effect, nothing committed is lost, no rolled-back effect was ever published; the redeliveries and
republishes that at-least-once produced are counted and shown absorbed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import aio_pika
import nats
import psycopg
import pytest
from conftest import create_database, drop_database, dsn_for
from helpers_brokers import RABBIT_URL, require, wait_for
from helpers_proxy import TcpProxy
from nats.js import api

pytestmark = pytest.mark.timeout(180)

B_SETUP = """
CREATE TABLE received(id text NOT NULL, amount int NOT NULL);  -- no unique key: a repeat would show
CREATE FUNCTION order_placed(payload jsonb) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO received VALUES (payload->>'id', (payload->>'amount')::int);
  PERFORM inbox.enqueue_effect('follow-' || (payload->>'id'), 'downstream', payload);
END $$;
SELECT inbox.register_handler('svc_b', 'order_placed', 'order_placed(jsonb)'::regprocedure, 'v1');
SELECT inbox.bind_destination('downstream', 'svc_b');
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class NatsServer:
    """A private nats-server -js with its own store directory, killable with SIGKILL."""

    def __init__(self, path: Path) -> None:
        self.port = free_port()
        self.store = path / "nats-store"
        self.store.mkdir(parents=True, exist_ok=True)
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = f"nats://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["nats-server", "-js", "-a", "127.0.0.1", "-p", str(self.port), "-sd", str(self.store)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_for(self._up, "the private nats-server", timeout=15)

    def _up(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                return True
        except OSError:
            return False

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)


class RedisServer:
    """A private redis-server whose append-only file is fsynced at every write (what a deployment
    that must not lose an XADD or an XACK runs), killable with SIGKILL and started again on it."""

    def __init__(self, path: Path) -> None:
        self.port = free_port()
        self.dir = path / "redis-data"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                "redis-server",
                "--bind",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--dir",
                str(self.dir),
                "--appendonly",
                "yes",
                "--appendfsync",
                "always",
                "--save",
                "",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_for(self._up, "the private redis-server", timeout=15)

    def _up(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stream_length(self, stream: str) -> int:
        out = subprocess.run(
            ["redis-cli", "-p", str(self.port), "XLEN", stream], capture_output=True, text=True, check=True
        )
        return int(out.stdout.strip())


class RabbitNode:
    """A private RabbitMQ node (own node name, ports, Mnesia and log directories), run as the
    rabbitmq user in a process group of its own, so that SIGKILL reaches its beam.smp."""

    def __init__(self) -> None:
        import pwd
        import tempfile

        self.port = free_port()
        self.dist_port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="pginbox-rmq-"))
        self.dir.chmod(0o755)
        (self.dir / "enabled_plugins").write_text("[].\n")
        (self.dir / "rabbitmq.conf").write_text(f"listeners.tcp.1 = 127.0.0.1:{self.port}\n")
        user = pwd.getpwnam("rabbitmq")
        for path in [self.dir, *self.dir.iterdir()]:
            os.chown(path, user.pw_uid, user.pw_gid)
        self.home = user.pw_dir
        self.node = f"pginbox_{uuid.uuid4().hex[:8]}@localhost"
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = f"amqp://guest:guest@127.0.0.1:{self.port}/"

    def start(self, timeout: float = 25.0) -> None:
        env = {
            "PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"),
            "HOME": self.home,
            "RABBITMQ_NODENAME": self.node,
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "RABBITMQ_MNESIA_BASE": str(self.dir / "mnesia"),
            "RABBITMQ_LOG_BASE": str(self.dir / "log"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.dir / "enabled_plugins"),
            "RABBITMQ_CONFIG_FILE": str(self.dir / "rabbitmq.conf"),
        }
        self.proc = subprocess.Popen(
            ["runuser", "-u", "rabbitmq", "--", "env", *(f"{k}={v}" for k, v in env.items()), "rabbitmq-server"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        wait_for(self._up, "the private RabbitMQ node", timeout=timeout, interval=0.2)

    def _up(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                pass
        except OSError:
            return False
        try:  # the listener may come up before the node accepts logins
            asyncio.run(rabbit_ping(self.url))
            return True
        except Exception:
            return False

    def kill(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def destroy(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)

    @classmethod
    def try_start(cls) -> RabbitNode | None:
        if os.geteuid() != 0 or shutil.which("rabbitmq-server") is None or shutil.which("runuser") is None:
            return None
        try:
            node = cls()
        except (KeyError, OSError):
            return None
        try:
            node.start()
        except AssertionError:
            node.destroy()
            return None
        return node


async def rabbit_ping(url: str) -> None:
    conn = await aio_pika.connect(url, timeout=2)
    await conn.close()


class Service:
    """A pginbox CLI process (dispatch or consume) that can be SIGKILLed and started again."""

    def __init__(self, args: list[str], env: dict[str, str], log: Path) -> None:
        self.args = args
        self.env = env
        self.log = log
        self.proc: subprocess.Popen[str] | None = None
        self.outputs: list[str] = []
        self.kills = 0

    def start(self) -> None:
        out = self.log.open("a")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pginbox", *self.args], env=self.env, stdout=subprocess.PIPE, stderr=out, text=True
        )
        out.close()

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.communicate(timeout=10)
        self.kills += 1

    def stop(self) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            out, _ = self.proc.communicate(timeout=40)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()
            raise
        self.outputs.append(out)
        return self.proc.returncode

    def ensure_dead(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()  # a process that exited by itself still holds its pipe


def counters(line: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for part in line.split():
        key, _, value = part.partition("=")
        if value.isdigit():
            out[key] = int(value)
    return out


async def nats_setup(url: str, stream: str, subject: str, durable: str) -> None:
    nc = await nats.connect(url, connect_timeout=2, max_reconnect_attempts=1)
    try:
        js = nc.jetstream()
        await js.add_stream(name=stream, subjects=[subject], storage=api.StorageType.FILE, duplicate_window=120.0)
        await js.add_consumer(
            stream,
            api.ConsumerConfig(
                durable_name=durable, ack_policy=api.AckPolicy.EXPLICIT, ack_wait=2.0, filter_subject=subject
            ),
        )
    finally:
        await nc.close()


async def nats_stream_count(url: str, stream: str) -> int:
    nc = await nats.connect(url, connect_timeout=2, max_reconnect_attempts=1)
    try:
        return int((await nc.jetstream().stream_info(stream)).state.messages)
    finally:
        await nc.close()


async def nats_delete(url: str, stream: str) -> None:
    nc = await nats.connect(url, connect_timeout=2, max_reconnect_attempts=1)
    try:
        await nc.jetstream().delete_stream(stream)
    finally:
        await nc.close()


async def rabbit_queue(url: str, queue: str, delete: bool = False) -> None:
    conn = await aio_pika.connect(url)
    try:
        ch = await conn.channel()
        if delete:
            for name in (queue, f"{queue}.dead"):
                await ch.queue_delete(name)
        else:
            await ch.declare_queue(queue, durable=True)
    finally:
        await conn.close()


@pytest.mark.parametrize("broker", ["rabbitmq", "nats", "redis"])
def test_chain_under_crashes(
    broker: str, conn: psycopg.Connection[Any], db_dsn: str, pg_base: str, template_db: str, tmp_path: Path
) -> None:
    require(broker)
    if broker == "nats" and shutil.which("nats-server") is None:
        pytest.fail("nats-server is not installed (./dev.sh setup installs it): this test restarts a private one")
    if broker == "redis" and shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed (./dev.sh setup installs it): this test restarts a private one")
    name = f"chain_{uuid.uuid4().hex[:8]}"
    b_db = f"t_{uuid.uuid4().hex}"
    create_database(pg_base, b_db, template=template_db)
    b_dsn = dsn_for(pg_base, b_db)
    server: NatsServer | RedisServer | RabbitNode | None = None
    services: list[Service] = []
    closing = "broker restarted"
    try:
        with psycopg.connect(b_dsn, autocommit=True) as b:
            b.execute(B_SETUP)
        conn.execute("CREATE TABLE orders(id text PRIMARY KEY, amount int NOT NULL)")
        conn.execute("SELECT inbox.configure_destination('chain', 1000, '50 milliseconds', '500 milliseconds')")
        if broker == "nats":
            server = NatsServer(tmp_path)
            server.start()
            target = server.url
            stream, subject = name.upper(), f"{name}.orders"
            asyncio.run(nats_setup(target, stream, subject, name))
        elif broker == "redis":
            server = RedisServer(tmp_path)
            server.start()
            target = server.url
            stream = name
        else:
            server = RabbitNode.try_start()
            if server is None:
                closing = "no private RabbitMQ node could be started: connection cuts only, no broker restart"
            target = RABBIT_URL if server is None else server.url
            asyncio.run(rabbit_queue(target, name))
        host_port = target.split("@")[-1].split("://")[-1].split("/")[0]
        host, _, port = host_port.rpartition(":")
        with TcpProxy(host, int(port)) as proxy:
            url = {
                "rabbitmq": f"amqp://guest:guest@127.0.0.1:{proxy.port}/",
                "nats": f"nats://127.0.0.1:{proxy.port}",
                "redis": f"redis://127.0.0.1:{proxy.port}/0",
            }[broker]
            dest = tmp_path / "dest.toml"
            if broker == "rabbitmq":
                dest.write_text(
                    f'[destinations.chain]\nurl = "{url}"\nrouting_key = "{name}"\n'
                    'producer = "svc_a"\nmessage_type = "order_placed"\ntimeout = 3.0\n'
                )
            elif broker == "redis":
                dest.write_text(
                    f'[destinations.chain]\nurl = "{url}"\nstream = "{stream}"\n'
                    'producer = "svc_a"\nmessage_type = "order_placed"\ntimeout = 3.0\n'
                )
            else:
                dest.write_text(
                    f'[destinations.chain]\nurl = "{url}"\nsubject = "{subject}"\n'
                    'producer = "svc_a"\nmessage_type = "order_placed"\ntimeout = 3.0\n'
                )
            env = {k: v for k, v in os.environ.items() if not k.startswith("PGINBOX_")}
            dispatcher = Service(
                [
                    "dispatch",
                    "--dsn",
                    db_dsn,
                    "--config",
                    str(dest),
                    "--name",
                    "chain-a",
                    "--lease",
                    "3",
                    "--poll-interval",
                    "0.2",
                    "--defer-after",
                    "1",
                ],
                env,
                tmp_path / "dispatch.log",
            )  # a queue not back yet after the restart: 1 s
            consume_env = {
                **env,
                "PGINBOX_DSN": b_dsn,
                "PGINBOX_CONSUME_URL": url,
                "PGINBOX_CONSUME_CONSUMER": "svc_b",
                "PGINBOX_CONSUME_PREFETCH": "20",
                "PGINBOX_CONSUME_RETRY_DELAY": "0.2",
            }
            if broker == "rabbitmq":
                consume_env["PGINBOX_CONSUME_QUEUE"] = name
            elif broker == "redis":  # a SIGKILLed consumer's entries are claimed after 2 s
                consume_env.update({"PGINBOX_CONSUME_STREAM": stream, "PGINBOX_CONSUME_CLAIM_IDLE": "2"})
            else:
                consume_env.update({"PGINBOX_CONSUME_STREAM": stream, "PGINBOX_CONSUME_DURABLE": name})
            consumer = Service(["consume"], consume_env, tmp_path / "consume.log")
            services[:] = [dispatcher, consumer]
            dispatcher.start()
            consumer.start()

            committed: list[str] = []
            rolled_back: list[str] = []
            total = 500

            def write() -> None:
                with psycopg.connect(db_dsn, autocommit=True) as a:
                    for i in range(total):
                        oid = f"o{i}"
                        rollback = i % 9 == 4
                        with a.transaction(force_rollback=rollback):
                            a.execute("INSERT INTO orders VALUES (%s, %s)", (oid, i))
                            a.execute(
                                "SELECT inbox.enqueue_effect(%s, 'chain', %s::jsonb)",
                                (oid, json.dumps({"id": oid, "amount": i})),
                            )
                        (rolled_back if rollback else committed).append(oid)
                        time.sleep(0.008)

            writer = threading.Thread(target=write)
            writer.start()

            def received() -> dict[str, int]:
                with psycopg.connect(b_dsn, autocommit=True) as b:
                    rows = b.execute("SELECT id, count(*) FROM received GROUP BY id").fetchall()
                return {r[0]: int(r[1]) for r in rows}

            wait_for(lambda: len(received()) >= 30, "the chain running", timeout=60)
            dispatcher.kill()  # SIGKILL the dispatcher: its leases expire
            dispatcher.start()
            wait_for(lambda: len(received()) >= 120, "progress after the dispatcher's SIGKILL", timeout=60)
            consumer.kill()  # SIGKILL the consumer mid-batch: unacked come back
            consumer.start()
            wait_for(lambda: len(received()) >= 200, "progress after the consumer's SIGKILL", timeout=60)
            proxy.cut()  # every broker connection dropped
            wait_for(lambda: len(received()) >= 260, "progress after a connection cut", timeout=60)
            if server is not None:
                server.kill()  # the broker itself dies (SIGKILL) ...
                time.sleep(0.5)
                server.start()  # ... and comes back with its store
                proxy.cut()
            else:
                proxy.cut()
            wait_for(lambda: len(received()) >= 320, "progress after the broker restart", timeout=60)
            proxy.cut()
            writer.join(60)
            assert not writer.is_alive()
            try:
                wait_for(lambda: len(received()) >= len(committed), "every committed effect at B", timeout=90)
            except AssertionError:
                for log in ("dispatch.log", "consume.log"):  # what the services said, for the report
                    lines = (tmp_path / log).read_text(errors="replace").splitlines()
                    print(f"---- {log} (last 40 lines)", *lines[-40:], sep="\n")
                raise

            def undelivered_at_a() -> int:
                row = conn.execute(
                    "SELECT count(*) FROM inbox.outbox WHERE destination = 'chain' AND status::text <> 'delivered'"
                ).fetchone()
                return int(row[0]) if row else -1

            # an effect whose confirm was lost is published again (same id) until it is recorded
            wait_for(lambda: undelivered_at_a() == 0, "every effect recorded as delivered at A", timeout=60)
            time.sleep(1.0)  # late redeliveries, if any, would show up as repeats now
            assert consumer.stop() == 0
            assert dispatcher.stop() == 0

            got = received()
            repeats = {k: v for k, v in got.items() if v != 1}
            assert not repeats, f"applied more than once at B: {repeats}"
            assert set(got) == set(committed), (
                sorted(set(committed) - set(got))[:10],
                sorted(set(got) - set(committed))[:10],
            )
            assert not set(got) & set(rolled_back)
            with psycopg.connect(b_dsn, autocommit=True) as b:
                follow = b.execute(
                    "SELECT count(*), count(DISTINCT effect_id) FROM inbox.outbox WHERE destination = 'downstream'"
                ).fetchone()
                inbox_row = b.execute("SELECT count(*) FROM inbox.message WHERE consumer = 'svc_b'").fetchone()
            assert follow == (len(committed), len(committed))
            assert inbox_row is not None and inbox_row[0] == len(committed)
            row = conn.execute(
                "SELECT count(*), coalesce(sum(attempts), 0), "
                "count(*) FILTER (WHERE status::text <> 'delivered') "
                "FROM inbox.outbox WHERE destination = 'chain'"
            ).fetchone()
            assert row is not None
            effects, attempts, undelivered = row
            assert effects == len(committed) and undelivered == 0
            assert not (
                set(rolled_back) & {r[0] for r in conn.execute("SELECT effect_id FROM inbox.outbox").fetchall()}
            )
            last = counters(consumer.outputs[-1].strip().splitlines()[-1]) if consumer.outputs[-1].strip() else {}
            stream_count = None
            if broker == "nats":
                stream_count = asyncio.run(nats_stream_count(target, stream))
            elif isinstance(server, RedisServer):
                stream_count = server.stream_length(stream)
            summary = (
                f"{broker}: committed={len(committed)} rolled_back={len(rolled_back)} "
                f"dispatch_attempts={attempts} (republished {attempts - effects}) "
                f"stream_messages={stream_count} dispatcher_kills={dispatcher.kills} "
                f"consumer_kills={consumer.kills} cuts={proxy.cuts} "
                f"last consumer run: duplicates absorbed={last.get('duplicate', 0)} "
                f"redeliveries={last.get('redeliveries', 0)}; applied once each at B; {closing}"
            )
            print(summary)
            if broker == "nats":  # the stream's duplicate window dropped the republishes
                assert stream_count == len(committed)
            elif stream_count is not None:  # Redis keeps republishes: B answered them `duplicate`
                assert stream_count >= len(committed)
    finally:
        for s in services:
            s.ensure_dead()
        if isinstance(server, RabbitNode):
            server.destroy()
        elif server is not None:
            server.kill()
        else:
            with contextlib.suppress(Exception):
                asyncio.run(rabbit_queue(RABBIT_URL, name, delete=True))
        drop_database(pg_base, b_db)
