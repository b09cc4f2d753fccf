"""Tests for ddops and its engine."""
