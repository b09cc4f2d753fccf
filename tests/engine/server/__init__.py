"""Tests of engine/server/ (the folders mirror the source)."""
