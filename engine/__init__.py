"""The bundled DDTree engine: own model code, DFlash drafter, DDTree decoding, HTTP server.

The engine works on token ids; the tokenizer and the HTTP layer wrap it.
Run `python -m engine --help`.
"""

__version__ = "0.1.0"
