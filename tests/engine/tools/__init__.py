"""Tests of engine/tools/ (the folders mirror the source)."""
