"""Integrations with model libraries (each imports its library lazily: install the matching extra)."""
