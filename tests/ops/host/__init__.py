"""Tests of ops/host/ (the folders mirror the source)."""
