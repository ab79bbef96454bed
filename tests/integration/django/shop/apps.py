from django.apps import AppConfig


class ShopConfig(AppConfig):
    name = "shop"

    def ready(self):
        from . import extra  # noqa: F401  # the tests' own handlers, on the same bus
