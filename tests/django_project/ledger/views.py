import json

from django.db import transaction
from django.http import HttpRequest, JsonResponse

from ledger.models import Account, Entry, Order
from pginbox import Message
from pginbox.integrations.django import DjangoInbox, enqueue

inbox = DjangoInbox(consumer="billing", handler_version="v1")


def credit(m: Message) -> None:
    """The handler: ORM code, in the transaction that holds the claim."""
    account, _ = Account.objects.select_for_update().get_or_create(id=m.payload["account"])
    account.balance += m.payload["amount"]
    account.save(update_fields=["balance"])
    Entry.objects.create(account=account, message_id=m.message_id, amount=m.payload["amount"])


@transaction.non_atomic_requests  # ATOMIC_REQUESTS=True: handle() runs its own transaction
def webhook(request: HttpRequest) -> JsonResponse:
    """A message pushed over HTTP: 2xx is the ack, anything else asks the sender to retry."""
    body = json.loads(request.body)
    result = inbox.handle(Message(body["producer"], body["id"], "credit", body["payload"]), credit)
    return JsonResponse({"outcome": result.outcome.value}, status=200 if result.ack else 503)


def webhook_in_request_transaction(request: HttpRequest) -> JsonResponse:
    """The same view without @transaction.non_atomic_requests: refused (PginboxError)."""
    body = json.loads(request.body)
    result = inbox.handle(Message(body["producer"], body["id"], "credit", body["payload"]), credit)
    return JsonResponse({"outcome": result.outcome.value})


def place_order(request: HttpRequest) -> JsonResponse:
    """A producer: the order and its effect commit together (ATOMIC_REQUESTS' transaction)."""
    body = json.loads(request.body)
    order, created = Order.objects.get_or_create(id=body["order"], defaults={"amount": body["amount"]})
    enqueue(f"order-{order.id}:crm", "crm", {"order": order.id, "amount": order.amount}, consumer="shop-api")
    return JsonResponse({"order": order.id, "created": created}, status=201 if created else 200)
