from django.urls import path
from ledger import views

urlpatterns = [
    path("webhook", views.webhook),
    path("webhook-in-request-transaction", views.webhook_in_request_transaction),
    path("orders", views.place_order),
]
