"""The bundled DDTree engine: own model code, DFlash drafter, DDTree decoding, HTTP server.

The engine works on token ids; the tokenizer and the HTTP layer wrap it.
Run `python -m engine --help`.
"""

__version__ = "0.1.0"

# The modules the control plane (ops/) may import: torch-free (no torch, transformers or triton),
# so a host's ddops, installed without the engine extra, runs them. `engine.server` is the
# package alone (API_KEY_ENV), not its modules. tests/test_structure.py holds both: ops imports
# no other engine module, and importing these loads none of those libraries.
TORCH_FREE = (
    "engine.bench_stats",
    "engine.machine_state",
    "engine.memory_plan",
    "engine.methods",
    "engine.server",
)
