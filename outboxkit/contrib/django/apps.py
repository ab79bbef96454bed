"""The Django app: ``INSTALLED_APPS = [..., "outboxkit.contrib.django"]``."""

from __future__ import annotations

from django.apps import AppConfig


class OutboxkitConfig(AppConfig):  # type: ignore[misc]  # Django has no type hints
    name = "outboxkit.contrib.django"
    label = "outboxkit"
    verbose_name = "outboxkit"
    default_auto_field = "django.db.models.BigAutoField"
