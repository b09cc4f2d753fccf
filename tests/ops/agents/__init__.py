"""Tests of ops/agents/ (the folders mirror the source)."""
