"""Settings of the example app (``examples.tasks``), read when the app is first configured.

``REDIS_URL`` is the broker, the result backend and the locks' Redis (default
``redis://127.0.0.1:6379/0``); ``EXAMPLES_QUEUE`` the queue the examples use
(default ``celery``; the runnable examples pick one of their own).
"""

import os

broker_url = result_backend = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
task_default_queue = os.environ.get("EXAMPLES_QUEUE", "celery")
result_expires = 600
worker_prefetch_multiplier = 1
broker_connection_retry_on_startup = True

# Two beat instances (docker-compose.yml runs two) both send this every 10 s;
# send_digest's until_expired lock lets one send per 8 s through. Once-per-slot
# beat jobs (the schedule slot as the key, whatever the beats' clocks) come with
# the beat support of celery-redislock.
beat_schedule = {
    "digest-every-10s": {"task": "examples.tasks.send_digest", "schedule": 10.0},
}
