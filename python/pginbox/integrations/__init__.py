"""Integrations with other Python database toolkits (optional extras)."""
