"""The Django tests run in a pytest of their own, configured by ``project.settings``
(``test_django_project.py`` starts it, once per backend): pytest-django stays inactive in the
rest of the suite. Without ``DJANGO_SETTINGS_MODULE``, the suite here is not collected."""

import os

DJANGO = os.environ.get("DJANGO_SETTINGS_MODULE") == "project.settings"
collect_ignore = [] if DJANGO else ["suite", "shop", "project", "manage.py"]

if DJANGO:
    # As the README's conftest.py: outboxkit's fixtures on the test database.
    import pytest

    from outboxkit.contrib.django.testing import outbox_store  # noqa: F401

    @pytest.fixture
    def outbox(outbox_store, outbox_clock):  # noqa: F811
        """What ini ``outboxkit_app = shop.events:outbox`` gives an app's tests (the README's);
        here tests/conftest.py's memory outbox must be overridden."""
        from shop.events import outbox as app

        return app.rebind(store=outbox_store, clock=outbox_clock)
