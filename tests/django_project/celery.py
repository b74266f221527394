"""The project's Celery app, as Celery's Django guide lays it out: created with
``DJANGO_SETTINGS_MODULE`` set, so that Celery's Django fixup makes its tasks ``DjangoTask``s."""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.django_project.settings")

app = Celery("django_project")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
