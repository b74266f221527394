"""A Django project using ``LockedTask`` (``tests/test_django.py``): SQLite, Redis as broker,
results and locks, configured from the environment (``settings.py``)."""

from .celery import app

__all__ = ["app"]
