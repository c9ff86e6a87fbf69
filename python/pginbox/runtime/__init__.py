"""What the long-running commands share (`pginbox consume` and `pginbox dispatch`), tied to neither.

log.py       kv(): the `event key=value ...` log line
backoff.py   jittered() (reconnects, pauses, failed claims) and doubling() (a failed message's delay)
health.py    HealthServer: GET /healthz and GET /metrics of anything Monitored
metrics.py   Metrics: a Prometheus registry of one daemon, and its counters
aioloop.py   LoopThread: an asyncio loop on a daemon thread (broker publishers under the dispatcher)
loading.py   load_object("module:attribute"): handlers, callables, factories
"""

from pginbox.runtime.backoff import doubling, jittered
from pginbox.runtime.health import HealthServer, Monitored
from pginbox.runtime.loading import load_object
from pginbox.runtime.log import kv

__all__ = ["HealthServer", "Monitored", "doubling", "jittered", "kv", "load_object"]
