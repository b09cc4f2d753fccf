"""The engine's OpenAI-compatible HTTP server.

- app.py: the FastAPI app, its service routes (health, ready, metrics, models, tokenize) and
  `load_engine` (what `python -m engine serve` runs); state.py: the state the APIs share;
- a module per API: completions.py, chat_completions.py (both answer in choices.py's shape),
  responses.py (the Responses API: response_input.py translates a request into the chat
  request it asks for, response_output.py dresses chat's parsed output as output items), over
  one generation path, generation.py (submit to the worker, events, usage, errors);
- schemas.py: request bodies, validated; body.py: reading them under a size limit;
- chat.py: prompts rendered from messages and tools (through engine/chat_template.py);
  tools.py, reasoning.py: tool calls and `<think>` blocks parsed back out of the generated text;
  text.py: incremental detokenisation;
- worker.py: the one thread that runs generations; metrics.py: /metrics; shutdown.py: draining
  at SIGTERM.
"""

API_KEY_ENV = "DDOPS_API_KEY"  # the API key when --api-key is not given; ops installs it in a CT
