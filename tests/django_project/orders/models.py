from django.db import models


class Order(models.Model):  # type: ignore[misc]  # Django is untyped here (pyproject.toml)
    item = models.CharField(max_length=100)
