"""Tests of engine/ (the folders mirror the source)."""
