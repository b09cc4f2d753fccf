"""Tests of ops/bench/ (the folders mirror the source)."""
