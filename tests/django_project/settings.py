"""Settings of the test project: the database file, the Redis URL and the key prefix come from
``DJANGO_PROJECT_DB``, ``DJANGO_PROJECT_REDIS`` and ``DJANGO_PROJECT_PREFIX``."""

import os

SECRET_KEY = "tests-only"
INSTALLED_APPS = ["tests.django_project.orders"]
DATABASES = {
    "default": {"ENGINE": "django.db.backends.sqlite3", "NAME": os.environ["DJANGO_PROJECT_DB"]},
}
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.AutoField"

PREFIX = os.environ["DJANGO_PROJECT_PREFIX"]
CELERY_BROKER_URL = CELERY_RESULT_BACKEND = os.environ["DJANGO_PROJECT_REDIS"]
CELERY_TASK_DEFAULT_QUEUE = f"q-{PREFIX}"
CELERY_REDISLOCK_PREFIX = PREFIX
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
