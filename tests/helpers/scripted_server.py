"""A scripted engine behind the real server app, served by uvicorn on loopback, for the HTTP tests.

`ScriptedEngine` has `engine.decode.generate`'s calling convention (on_tokens per round,
should_stop polled per round) and events to hold, watch and release a generation, so queueing,
cancellation and readiness are tested deterministically; `CharTokenizer` is one id per character.

    with running(ScriptedEngine()) as (url, state):
        complete(url, max_tokens=4)
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator

import httpx

from engine.chat_template import render
from engine.decode import GenerationConfig, GenerationResult
from engine.sampling import TokenLogprob
from engine.server.app import create_app
from engine.server.shutdown import draining_server
from engine.server.state import LoadedEngine, ServerConfig
from tests.helpers.conversations import DEMO_TARGET
from tests.helpers.tiny_grammar import codepoint_tokenizer

EOS = 0
WAIT_S = 10.0


class CharTokenizer:
    """One id per character (ord); id 0 is the eos. Its chat template writes "[role]content"."""

    eos_token_ids = (EOS,)
    chat_template = (
        "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}"
    )

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids if i != EOS)

    def render_chat(self, messages, add_generation_prompt=True, **inputs) -> str:
        return render(
            self.chat_template, messages, add_generation_prompt=add_generation_prompt, **inputs
        )


class AgentTokenizer(CharTokenizer):
    """One id per character, with the demo pair's chat template (Qwen3's structure)."""

    chat_template = (DEMO_TARGET / "chat_template.jinja").read_text()


def prompt_text(ids: list[int]) -> str:
    return "".join(chr(i) for i in ids if i != EOS)


class ScriptedEngine:
    """Commits `reply` + eos two ids per round; while `gate` is cleared, rounds wait (polling
    should_stop, as the real engine does once per round)."""

    def __init__(self, reply: str = "Hello world!") -> None:
        self.reply = reply
        self.gate = threading.Event()
        self.gate.set()
        self.started = threading.Event()
        self.cancelled = threading.Event()
        self.configs: list[GenerationConfig] = []

    def generate(
        self, prompt_ids, cfg, *, on_tokens=None, should_stop=None, on_logprobs=None
    ) -> GenerationResult:
        self.configs.append(cfg)
        self.started.set()
        ids = [ord(c) for c in self.reply] + [EOS]
        output, lengths, finish = [], [], "length"
        while len(output) < cfg.max_new_tokens:
            if self._stopped_before_round(should_stop, first=not output):
                finish = "cancelled"
                self.cancelled.set()
                break
            step = ids[len(output) : len(output) + 2][: cfg.max_new_tokens - len(output)]
            if on_logprobs:
                on_logprobs(
                    [scripted_logprob(t, len(output) + i, cfg.logprobs) for i, t in enumerate(step)]
                )
            output += step
            lengths.append(len(step))
            if on_tokens:
                on_tokens(step)
            if EOS in step:
                finish = "stop"
                break
        result = GenerationResult(output, finish, lengths, {}, 100.0, 0.01, None)
        if cfg.method == "auto":  # a node verified each round (of the two tokens it commits)
            result.budgets = [1] * len(lengths)
        if cfg.logprobs is not None:
            result.logprobs = [scripted_logprob(t, i, cfg.logprobs) for i, t in enumerate(output)]
        if cfg.prompt_logprobs is not None:
            scored = [scripted_logprob(t, i, cfg.prompt_logprobs) for i, t in enumerate(prompt_ids)]
            result.prompt_logprobs = [None, *scored[1:]]
        return result

    def _stopped_before_round(self, should_stop, *, first: bool) -> bool:
        stop = should_stop or (lambda: False)
        while not self.gate.wait(0.01):
            if stop():
                return True
        return not first and stop()


def scripted_logprob(token: int, position: int, top: int) -> TokenLogprob:
    """The scripted engine's logprob of `token` at output `position`: -position / 8, with `top`
    alternatives (the token, then the ids after it) a nat apart."""
    value = -position / 8
    return TokenLogprob(token, value, tuple((token + k, value - k) for k in range(top)))


class RecordingEngine(ScriptedEngine):
    """Also keeps each prompt it was given. With `turns` set (and `prompts` cleared), the
    requests are answered in turn, the last reply again after that (an agent's tool call, then
    its answer); else `reply` answers every request."""

    def __init__(self, reply: str) -> None:
        super().__init__(reply)
        self.turns: list[str] = []
        self.prompts: list[list[int]] = []

    def generate(self, prompt_ids, cfg, **callbacks):
        self.prompts.append(list(prompt_ids))
        if self.turns:
            self.reply = self.turns[min(len(self.prompts), len(self.turns)) - 1]
        return super().generate(prompt_ids, cfg, **callbacks)


def loaded(
    engine: ScriptedEngine,
    has_drafter: bool = True,
    max_model_len: int = 64,
    tokenizer: CharTokenizer | None = None,
) -> LoadedEngine:
    tokenizer = tokenizer or CharTokenizer()
    return LoadedEngine(
        engine.generate,
        tokenizer,
        max_model_len,
        0x110000,
        has_drafter,
        grammar_tokenizer=codepoint_tokenizer(),
    )


@contextlib.contextmanager
def serving(app) -> Iterator[str]:
    """Serve `app` as `engine serve` does (uvicorn, draining at shutdown) on a pre-bound loopback
    socket (connections queue until it runs)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    server = draining_server(app, log_config=None)  # uvicorn logs to the root logger (caplog)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(WAIT_S)
        sock.close()


@contextlib.contextmanager
def running(
    engine: ScriptedEngine | None = None,
    load: Callable[[], LoadedEngine] | None = None,
    **config,
) -> Iterator[tuple[str, object]]:
    engine = engine or ScriptedEngine()
    app = create_app(load or (lambda: loaded(engine)), ServerConfig(model_name="tiny", **config))
    with serving(app) as url:
        yield url, app.state.server


def complete(url: str, **body) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"prompt": "hi", **body}, timeout=WAIT_S)


def wait_until(predicate: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)
