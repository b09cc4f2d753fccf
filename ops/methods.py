"""The engine's decoding methods as ops names them (the inventory, the rendered units, the bench):
the one definition on the ops side (the engine's own is engine/methods.py)."""

METHODS = ("ar", "linear", "ddtree")
