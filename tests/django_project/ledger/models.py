"""The test app's domain: accounts, one ledger entry per applied message, and orders (a producer)."""

from __future__ import annotations

from typing import ClassVar

from django.db import models


class Account(models.Model):
    id: models.IntegerField[int, int] = models.IntegerField(primary_key=True)
    balance: models.BigIntegerField[int, int] = models.BigIntegerField(default=0)
    objects: ClassVar[models.Manager[Account]] = models.Manager()


class Entry(models.Model):
    account: models.ForeignKey[Account, Account] = models.ForeignKey(
        Account, on_delete=models.PROTECT, related_name="entries"
    )
    message_id: models.CharField[str, str] = models.CharField(max_length=200)
    amount: models.BigIntegerField[int, int] = models.BigIntegerField()
    # unique when given: a handler that repeats one fails on the constraint "ledger_entry_reference_key"
    reference: models.CharField[str | None, str | None] = models.CharField(max_length=100, null=True, default=None)
    objects: ClassVar[models.Manager[Entry]] = models.Manager()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["reference"], name="ledger_entry_reference_key")]


class Order(models.Model):
    id: models.CharField[str, str] = models.CharField(max_length=64, primary_key=True)
    amount: models.BigIntegerField[int, int] = models.BigIntegerField()
    objects: ClassVar[models.Manager[Order]] = models.Manager()
