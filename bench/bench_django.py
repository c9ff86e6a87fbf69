"""The Django integration's handle against pginbox.Inbox, measured in the same run (issue 25).

Starts a private cluster (fsync on), deploys sql/*.sql, migrates the test Django project
(tests/django_project, app `ledger`) into it, and runs one thread per workload, one message per
call, each workload in interleaved rounds (medians reported):

  inbox        pginbox.Inbox on a psycopg connection; the handler runs
               UPDATE ledger_account SET balance = balance + %s WHERE id = %s on the cursor
  django_raw   DjangoInbox.handle, the same UPDATE on Django's connection.cursor()
  django_orm   DjangoInbox.handle, the same change with the ORM:
               Account.objects.filter(id=...).update(balance=F("balance") + amount)

Target (issue 25): django_raw / inbox >= 0.8 (django_orm adds the ORM's own cost, reported too).
Django's connection keeps CONN_MAX_AGE=None and CONN_HEALTH_CHECKS=False (a worker's settings,
docs/django.md §7: with health checks on, Django adds a SELECT 1 round trip per message).
Usage:  .venv/bin/python bench/bench_django.py [--seconds 5] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import psycopg
from benchlib import ROOT, bench_database
from psycopg.conninfo import conninfo_to_dict

from pginbox import Inbox, Message, Outcome

ACCOUNTS = 1000
UPDATE = "UPDATE ledger_account SET balance = balance + %s WHERE id = %s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=5.0, help="duration of each run")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians are reported")
    args = parser.parse_args()

    with bench_database(prefix="pginbox-bench-django-") as (_cluster, dsn):
        params = conninfo_to_dict(dsn)
        os.environ.update(
            DJANGO_SETTINGS_MODULE="djproject.settings",
            PGINBOX_DJANGO_HOST=str(params.get("host", "127.0.0.1")),
            PGINBOX_DJANGO_PORT=str(params.get("port", "5432")),
            PGINBOX_DJANGO_NAME=str(params["dbname"]),
            PGINBOX_DJANGO_USER=str(params.get("user", "postgres")),
            PGINBOX_DJANGO_HEALTH_CHECKS="0",
        )
        sys.path.insert(0, str(ROOT / "tests" / "django_project"))
        import django

        django.setup()
        from django.core.management import call_command
        from django.db import connection
        from django.db.models import F
        from ledger.models import Account

        from pginbox.integrations.django import DjangoInbox

        call_command("migrate", verbosity=0)
        Account.objects.bulk_create([Account(id=i, balance=0) for i in range(1, ACCOUNTS + 1)])

        psy = psycopg.connect(dsn, autocommit=True)
        inbox = Inbox(psy, consumer="bench", handler_version="v1")
        dj = DjangoInbox(consumer="bench-django", handler_version="v1")
        serial = [0]

        def message() -> Message:
            serial[0] += 1
            n = serial[0]
            return Message("shop", f"m-{n}", "credit", {"account": n % ACCOUNTS + 1, "amount": 1})

        def raw_credit(cur: psycopg.Cursor[Any], m: Message) -> None:
            cur.execute(UPDATE, (m.payload["amount"], m.payload["account"]))

        def django_raw(m: Message) -> None:
            with connection.cursor() as cur:
                cur.execute(UPDATE, (m.payload["amount"], m.payload["account"]))

        def django_orm(m: Message) -> None:
            Account.objects.filter(id=m.payload["account"]).update(balance=F("balance") + m.payload["amount"])

        steps: dict[str, Callable[[], Outcome]] = {
            "inbox": lambda: inbox.handle(message(), raw_credit).outcome,
            "django_raw": lambda: dj.handle(message(), django_raw).outcome,
            "django_orm": lambda: dj.handle(message(), django_orm).outcome,
        }
        rates: dict[str, list[float]] = {name: [] for name in steps}
        cpu: dict[str, list[float]] = {name: [] for name in steps}
        for step in steps.values():  # warm-up: schema checks, connections, plans
            for _ in range(200):
                assert step() is Outcome.APPLIED
        for _ in range(args.rounds):
            for name, step in steps.items():
                done = 0
                began, cpu0 = time.perf_counter(), time.process_time()
                deadline = began + args.seconds
                while time.perf_counter() < deadline:
                    assert step() is Outcome.APPLIED
                    done += 1
                elapsed = time.perf_counter() - began
                rates[name].append(done / elapsed)
                cpu[name].append((time.process_time() - cpu0) / done * 1e6)
        psy.close()

    medians = {name: statistics.median(values) for name, values in rates.items()}
    report = {
        "messages_per_second": {k: round(v, 1) for k, v in medians.items()},
        "client_cpu_us_per_message": {k: round(statistics.median(v), 1) for k, v in cpu.items()},
        "ratios": {
            "django_raw/inbox": round(medians["django_raw"] / medians["inbox"], 3),
            "django_orm/inbox": round(medians["django_orm"] / medians["inbox"], 3),
        },
        "target": "django_raw/inbox >= 0.8",
        "seconds": args.seconds,
        "rounds": args.rounds,
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
