"""Tests of ops/chain/ (the folders mirror the source)."""
