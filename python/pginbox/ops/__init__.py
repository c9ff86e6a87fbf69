"""Operator tasks: quarantine decisions, status, outbox, retention, replay plans, metrics."""
