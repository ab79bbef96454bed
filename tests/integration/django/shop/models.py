# shop/models.py
from django.db import models


class Order(models.Model):
    item = models.CharField(max_length=100)
    quantity = models.IntegerField(default=1)


class LedgerLine(models.Model):
    order_id = models.BigIntegerField()
    line = models.CharField(max_length=100)
