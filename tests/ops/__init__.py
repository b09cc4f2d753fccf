"""Tests of ops/ (the folders mirror the source)."""
