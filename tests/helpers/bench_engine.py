"""A scripted engine for the bench's tests: an httpx transport answering like `python -m engine
serve` (/v1/models, /tokenize, /metrics, streamed /v1/completions) on a scripted clock.

    clock = ScriptedClock()
    engine = BenchEngine(clock=clock, step_s={"ar": 0.02, "ddtree": 0.03}, tau={"ddtree": 3.0})
    client = engine.client()                    # an EngineClient timed by `clock`
    engine.completions                          # every completion body, in order

Tokens are words (`word_count`); a completion of max_tokens streams one chunk per round (tau
tokens; ar: one), and the clock advances as each chunk is made (streams run on the client's
event loop; the engine decodes one request at a time, as today's engine does, so concurrent
requests wait for the one in progress): `prefill_s` per uncached prompt
token before the first, `step_s[method]` per round after it (a method's label, `ddtree:8`, or
its name), times `slowdown(n, body)` for the
n-th completion (1-based: a busy machine in the script), and each step times `contention(now)`
(other processes sharing the cores at that moment). A prefix cache keyed by the prompt's
text: with `cache_prompt` absent or true, a prompt reuses the longest stored prompt+output text
it starts with (reported as usage.prompt_tokens_details.cached_tokens) and stores its own.
`think` wraps the first tokens of each output in a `<think>` block. Request number `fail_at` is
a 500.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Callable

import httpx

from engine.machine_state import MachineWatch
from ops.bench.client import EngineClient

SERVED_BY_DEFAULT = {"method": "ddtree", "budget": 15}  # a request naming no method gets it


def word_count(text: str) -> int:
    """A tokenizer stand-in: words, single punctuation and single whitespace are tokens."""
    return len(re.findall(r"\w+|[^\w\s]|\s", text))


def sse(*chunks: dict) -> bytes:
    lines = [f"data: {json.dumps(chunk)}\n\n" for chunk in chunks]
    return ("".join(lines) + "data: [DONE]\n\n").encode()


def _event(chunk: dict) -> bytes:
    return f"data: {json.dumps(chunk)}\n\n".encode()


class ScriptedClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class BenchEngine:
    def __init__(
        self,
        max_model_len: int = 256,
        fail_at: int | None = None,
        *,
        clock: ScriptedClock | None = None,
        step_s: dict[str, float] | None = None,
        tau: dict[str, float] | None = None,
        prefill_s: float = 0.001,
        slowdown: Callable[[int, dict], float] = lambda n, body: 1.0,
        think: int = 0,
        contention: Callable[[float], float] = lambda now: 1.0,
    ) -> None:
        self.max_model_len = max_model_len
        self.fail_at = fail_at
        self.clock = clock or ScriptedClock()
        self.step_s = {"ar": 0.01, "linear": 0.01, "ddtree": 0.01, **(step_s or {})}
        self.tau = {"ar": 1.0, "linear": 2.0, "ddtree": 2.0, **(tau or {})}
        self.prefill_s = prefill_s
        self.slowdown = slowdown
        self.think = think
        self.contention = contention
        self.completions: list[dict] = []
        self.cached: list[str] = []
        self.cpu_s = 0.0
        self._locks: dict[int, asyncio.Lock] = {}  # one per event loop: one request at a time
        self.in_flight = self.peak_in_flight = 0  # streams open at once (waiting ones too)

    def client(self) -> EngineClient:
        transport = httpx.MockTransport(self)
        http = httpx.Client(base_url="http://engine", transport=transport)
        return EngineClient(
            "http://engine", http=http, stream_transport=transport, clock=self.clock
        )

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(
                200, json={"data": [{"id": "m", "max_model_len": self.max_model_len}]}
            )
        if request.url.path == "/metrics":
            return httpx.Response(
                200, text=f"# TYPE x counter\nprocess_cpu_seconds_total {self.cpu_s}\n"
            )
        body = json.loads(request.content)
        if request.url.path == "/tokenize":
            return httpx.Response(200, json={"count": word_count(body["prompt"])})
        self.completions.append(body)
        if len(self.completions) == self.fail_at:
            return httpx.Response(500, json={"error": {"message": "engine fell over"}})
        return httpx.Response(200, content=self._stream(body, len(self.completions)))

    def _work(self, seconds: float) -> None:
        """The engine computes for `seconds` on one core (longer while `contention` says other
        processes share the cores: each step is slowed as it runs, as on a real machine)."""
        seconds *= self.contention(self.clock.now)
        self.clock.advance(seconds)
        self.cpu_s += seconds

    def _reuse(self, prompt: str, cache: bool) -> int:
        if not cache:
            return 0
        hits = [c for c in self.cached if prompt.startswith(c)]
        return word_count(max(hits, key=len)) if hits else 0

    def _busy(self) -> asyncio.Lock:
        loop = id(asyncio.get_running_loop())
        return self._locks.setdefault(loop, asyncio.Lock())

    async def _stream(self, body: dict, number: int) -> AsyncIterator[bytes]:
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        await asyncio.sleep(0)  # the other clients send theirs before this one is served
        try:
            async with self._busy():
                for event in self._events(body, number):
                    yield event
                    await asyncio.sleep(0)  # the client reads it; other streams go on
        finally:
            self.in_flight -= 1

    def _events(self, body: dict, number: int):
        spec = body.get("speculative") or SERVED_BY_DEFAULT
        label = f"{spec['method']}:{spec['budget']}" if "budget" in spec else spec["method"]
        step = self.step_s.get(label, self.step_s[spec["method"]])
        per_round = max(1, round(self.tau.get(label, self.tau[spec["method"]])))
        tokens, prompt = body["max_tokens"], body["prompt"]
        cache = body.get("cache_prompt", True)
        factor = self.slowdown(number, body)
        cached = self._reuse(prompt, cache)
        words = [f"w{i} " for i in range(tokens)]
        if self.think:
            words[0] = "<think>"
            words[min(self.think, tokens - 1)] = "</think>"
        self._work(self.prefill_s * (word_count(prompt) - cached) * factor)
        yield _event({"choices": [{"text": words[0], "finish_reason": None}]})
        done, rounds = 1, 0
        while done < tokens:
            self._work(step * factor)
            text = "".join(words[done : done + per_round])
            done, rounds = done + per_round, rounds + 1
            yield _event({"choices": [{"text": text, "finish_reason": None}]})
        if cache:
            self.cached.append(prompt + "".join(words))
        usage = {"prompt_tokens": word_count(prompt), "completion_tokens": tokens}
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
        spec = {
            "method": spec["method"],
            "budget": spec.get("budget"),
            "rounds": rounds,
            "mean_acceptance_length": (done - 1) / rounds if rounds else 0,
        }
        yield sse(
            {"choices": [{"text": "", "finish_reason": "length"}], "speculative": spec},
            {"choices": [], "usage": usage},
        )


class Bursts:
    """Other processes taking `share` of all cores for the first `busy_s` of every `period_s`
    (on the scripted clock), idle the rest: `others_s(t)` is their CPU time up to `t` (in
    all-cores seconds), `busy_at(t)` whether a burst runs at `t`."""

    def __init__(self, period_s: float, busy_s: float, share: float = 1.0) -> None:
        self.period_s, self.busy_s, self.share = period_s, busy_s, share

    def busy_at(self, t: float) -> bool:
        return t % self.period_s < self.busy_s

    def others_s(self, t: float) -> float:
        periods, into = divmod(t, self.period_s)
        return self.share * (periods * self.busy_s + min(into, self.busy_s))


class ScriptedMachine:
    """The /proc of a machine running the engine while other processes take `others` of all its
    `cpus` cores (a share, or `Bursts`), on the engine's clock: `watch()` reads it."""

    def __init__(self, engine: BenchEngine, cpus: int = 2, others: float | Bursts = 0.25) -> None:
        self.engine, self.cpus, self.others = engine, cpus, others

    def _others_jiffies(self, now: float) -> float:
        if isinstance(self.others, Bursts):
            return self.others.others_s(now) * 100 * self.cpus
        return self.others * now * 100 * self.cpus

    def read(self, path: str) -> str:
        total = round(self.engine.clock.now * 100 * self.cpus)
        busy = round(self.engine.cpu_s * 100 + self._others_jiffies(self.engine.clock.now))
        if path == "/proc/stat":
            lines = [f"cpu  {busy} 0 0 {total - busy} 0 0 0 0 0 0"]
            return "\n".join(lines + [f"cpu{i} 0 0 0 0" for i in range(self.cpus)]) + "\n"
        if path == "/proc/loadavg":
            share = self.others.share if isinstance(self.others, Bursts) else self.others
            return f"{1 + share * self.cpus:.2f} 1.00 1.00 2/300 4242\n"
        raise FileNotFoundError(path)

    def own_cpu_s(self) -> float:
        return self.engine.cpu_s

    def watch(self) -> MachineWatch:
        return MachineWatch(
            self.read, None, self.own_cpu_s, self.engine.clock, self.engine.clock.advance
        )
