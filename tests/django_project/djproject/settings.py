"""A minimal Django project for the pginbox Django integration's tests (tests/python/e2e/test_django.py).

The database comes from the environment: PGINBOX_DJANGO_HOST, _PORT, _NAME, _USER (a PostgreSQL
with schema inbox deployed; the user is bound to the consumers the app acts as). Alias "unprepared"
is the same database with OPTIONS prepare_threshold None; alias "pooled" the same database through a
PgBouncer (PGINBOX_DJANGO_POOLED_PORT), alias "lossy" through the COMMIT-dropping proxy of the tests
(PGINBOX_DJANGO_LOSSY_PORT), when set.
"""

from __future__ import annotations

import os
from typing import Any

SECRET_KEY = "pginbox-tests-only"
DEBUG = False
USE_TZ = True
INSTALLED_APPS = ["ledger"]
ROOT_URLCONF = "djproject.urls"
ALLOWED_HOSTS = ["testserver", "localhost"]
MIDDLEWARE: list[str] = []
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"


def _database(port: str) -> dict[str, Any]:
    return {
        "ENGINE": "django.db.backends.postgresql",
        "HOST": os.environ.get("PGINBOX_DJANGO_HOST", "127.0.0.1"),
        "PORT": port,
        "NAME": os.environ.get("PGINBOX_DJANGO_NAME", "pginbox_django"),
        "USER": os.environ.get("PGINBOX_DJANGO_USER", "postgres"),
        # a worker keeps its connection (0, Django's default, closes it at every close_old_connections)
        "CONN_MAX_AGE": None,
        # Django checks the connection (SELECT 1) at its first use after each close_old_connections,
        # which DjangoInbox.handle calls per message: one more round trip each (bench_django.py turns
        # it off; a dead connection is a transient error DjangoInbox retries on a new one anyway).
        "CONN_HEALTH_CHECKS": os.environ.get("PGINBOX_DJANGO_HEALTH_CHECKS", "1") == "1",
        # every view in a transaction: what DjangoInbox.handle must refuse to run inside
        "ATOMIC_REQUESTS": True,
        "OPTIONS": {"options": "-c statement_timeout=60000"},
    }


DATABASES = {"default": _database(os.environ.get("PGINBOX_DJANGO_PORT", "5432"))}
# the same database where the project turned prepared statements off itself (Django's default is
# None too, but unsaid: DjangoInbox prepares its claim then)
DATABASES["unprepared"] = _database(os.environ.get("PGINBOX_DJANGO_PORT", "5432"))
DATABASES["unprepared"]["OPTIONS"]["prepare_threshold"] = None
# the same database through a PgBouncer in transaction mode, when the tests started one
if os.environ.get("PGINBOX_DJANGO_POOLED_PORT"):
    DATABASES["pooled"] = _database(os.environ["PGINBOX_DJANGO_POOLED_PORT"])
if os.environ.get("PGINBOX_DJANGO_LOSSY_PORT"):
    DATABASES["lossy"] = _database(os.environ["PGINBOX_DJANGO_LOSSY_PORT"])
