"""The engine's OpenAI-compatible HTTP server.

- app.py: the Starlette app, its routes and `load_engine` (what `python -m engine serve` runs);
- schemas.py: request bodies, validated; body.py: reading them under a size limit;
- chat.py, chat_template.py: prompts rendered from messages and tools; tools.py, reasoning.py:
  tool calls and `<think>` blocks parsed back out of the generated text; text.py: incremental
  detokenisation;
- worker.py: the one thread that runs generations; metrics.py: /metrics; shutdown.py: draining
  at SIGTERM.
"""

API_KEY_ENV = "DDOPS_API_KEY"  # the server's API key when --api-key is not given
