"""Shared test helpers: tiny models, local servers, and where the repository's files are."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "data"  # real-world-shaped inputs: CT configs, chat templates, configs
