"""Tests of sim/ (the folders mirror the source)."""
