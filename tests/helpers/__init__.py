"""Shared test helpers: tiny models, local servers."""
