"""Data the engine's tools and benchmarks share (the demo corpus and its held-out prompts)."""
