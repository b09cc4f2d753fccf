"""Tests of ops/site/ (the folders mirror the source)."""
