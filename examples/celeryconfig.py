"""Settings of the example app (``examples.tasks``), read when the app is first configured.

``REDIS_URL`` is the broker, the result backend and the locks' Redis (default
``redis://127.0.0.1:6379/0``); ``EXAMPLES_QUEUE`` the queue the examples use
(default ``celery``; the runnable examples pick one of their own);
``EXAMPLES_BEAT_EVERY`` the beat job's interval in seconds (default 10).
"""

import os

broker_url = result_backend = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
task_default_queue = os.environ.get("EXAMPLES_QUEUE", "celery")
result_expires = 600
worker_prefetch_multiplier = 1
broker_connection_retry_on_startup = True

# Beat sends send_digest every EXAMPLES_BEAT_EVERY seconds (default 10; the demo and
# examples.once_per_slot use 1); its lock_beat=True runs it once per slot, however many
# beats send it (docker-compose.yml runs two). The entry's name carries the interval,
# so that slots of different intervals never share a marker.
_every = float(os.environ.get("EXAMPLES_BEAT_EVERY", "10"))
beat_schedule = {
    f"digest-every-{_every:g}s": {"task": "examples.tasks.send_digest", "schedule": _every},
}
