"""The bench's HTTP client for the engine's OpenAI-compatible API (httpx, streaming).

    with EngineClient("http://127.0.0.1:8000", api_key=None) as client:
        client.max_model_len()                         # from /v1/models
        client.count_tokens("some text")               # the server's own /tokenize count
        done = client.complete("prompt", max_tokens=256, method=Method("ddtree", 15))
        done.text, done.sample.decode_tok_s, done.sample.tau
        client.run(coroutine)                          # on the client's own event loop

Every completion streams (server-sent events) through one asyncio event loop the client keeps
(ops/bench/load.py sends many at once on it), and each event is parsed as it arrives, so the
client sees when text arrives: TTFT = request sent -> first text; decode tok/s = tokens after
the first / time after the first; end-to-end tok/s = tokens / (request sent -> stream end).
"Sent" is when the request's first header is written to its connection (httpcore's trace
event, as guidellm counts), so neither a connection's opening nor a wait for a free one counts
as the server's; where the transport does not say (a test's), when the call began. "First
text" is the first event whose text is not empty (guidellm's first token; vLLM's bench takes
the first event with any choice, the same on this engine, which sends no empty ones before).
TPOT = the inverse of decode tok/s; ITL = the time between one token's arrival and the next's,
per token: a chunk carrying k tokens (a speculative round) is one gap then k - 1 zeros. A chunk's
tokens are the usage count shared out by the chunks' text lengths (`tokens_per_chunk`), since a
stream says how many tokens it sent only at its end. TTFT is the client's: it includes any wait
in the engine's queue. Token counts come from the
stream's usage chunk (`prompt_tokens_details.cached_tokens`: prompt tokens the prefix cache
served), tau (mean tokens committed per round, bonus included) and rounds from its
`speculative` stats. Reasoning: an output inside a `<think>` block (opened by the prompt or by
the output) has its reasoning tokens counted (`completion_tokens_details.reasoning_tokens`, else
the server's /tokenize count of the block); the rest are answer tokens, and decode tok/s counts
both. `cache_prompt=False` asks the engine not to reuse its prefix cache for this request (the
cache-off turns of the agentic scenario). Errors become DdopsError naming the engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import TypeVar

import httpx

from engine.methods import TREE_METHODS
from ops.bench.matrix import Method
from ops.errors import DdopsError

REQUEST_TIMEOUT_S = 600.0
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
ENGINE_CPU_METRIC = "process_cpu_seconds_total"
T = TypeVar("T")


@dataclass(frozen=True)
class Sample:
    """One measured request."""

    prompt_tokens: int
    completion_tokens: int
    ttft_s: float  # request sent (its first header written) -> first text
    decode_s: float  # first text -> last text
    e2e_s: float  # request sent -> end of the stream
    rounds: int
    tau: float  # mean tokens committed per round (0 for a request without rounds)
    cached_tokens: int | None = None  # prompt tokens served by the prefix cache (None: unsaid)
    reasoning_tokens: int | None = None  # tokens inside a <think> block (None: no block)
    start_s: float = 0.0  # when it was sent, from the start of its window (ops/bench/load.py)
    itl_s: list[float] | None = None  # gaps between tokens' arrivals (None: stored before 37)
    served: str | None = None  # the method the server says it decoded with (`ddtree:15`)

    @property
    def decode_tok_s(self) -> float | None:
        """Tokens after the first over the time after the first; None below two tokens."""
        if self.completion_tokens < 2 or self.decode_s <= 0:
            return None
        return (self.completion_tokens - 1) / self.decode_s

    @property
    def tpot_s(self) -> float | None:
        rate = self.decode_tok_s
        return 1.0 / rate if rate else None

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> Sample:
        """A stored sample (the fields of where it was measured, such as its repeat, aside)."""
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data})


@dataclass(frozen=True)
class Completion:
    text: str
    finish_reason: str | None
    sample: Sample


@dataclass(frozen=True)
class CompletionRequest:
    """What one completion asks for."""

    prompt: str
    max_tokens: int
    method: Method
    temperature: float = 0.0
    seed: int | None = 0
    cache_prompt: bool = True

    def body(self) -> dict:
        return {
            "prompt": self.prompt,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "seed": self.seed,
            "stream": True,
            "stream_options": {"include_usage": True},
            **({"speculative": spec} if (spec := self.method.speculative()) else {}),
            **({} if self.cache_prompt else {"cache_prompt": False}),
        }


class EngineClient:
    """A session with one engine; the API key (if any) goes in the Authorization header only."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        *,
        timeout: float = REQUEST_TIMEOUT_S,
        http: httpx.Client | None = None,
        stream_transport: httpx.AsyncBaseTransport | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.clock = clock  # what times the stream (tests give a scripted clock)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = http or httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout)
        self._stream_settings = {"headers": headers, "timeout": timeout}
        self._stream_transport = stream_transport  # tests: a scripted engine
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: httpx.AsyncClient | None = None
        self._model_card: dict | None = None

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()
        if self._loop is not None:
            if self._streams is not None:
                self._loop.run_until_complete(self._streams.aclose())
            self._loop.close()
            self._loop = self._streams = None

    def run(self, coroutine: Awaitable[T]) -> T:
        """Run `coroutine` to its end on this client's event loop (kept, so its connections
        are reused from one request to the next)."""
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        return self._loop.run_until_complete(coroutine)

    def streams(self) -> httpx.AsyncClient:
        """The asynchronous HTTP client the completions stream through (inside `run`)."""
        if self._streams is None:
            self._streams = httpx.AsyncClient(
                base_url=self.base_url,
                transport=self._stream_transport,
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
                **self._stream_settings,
            )
        return self._streams

    @property
    def label(self) -> str:
        return f"engine at {self.base_url}"

    # -- plain requests -------------------------------------------------------------------------
    def _request(self, method: str, path: str, body: dict | None = None) -> dict:
        try:
            response = self._http.request(method, path, json=body)
        except httpx.HTTPError as exc:
            raise DdopsError(self.label, f"{path}: {exc}") from exc
        if response.status_code != 200:
            raise DdopsError(
                self.label, f"{path} answered {response.status_code}: {_why(response)}"
            )
        return response.json()

    def ready(self) -> bool:
        """True when /ready answers 200 (model loaded, warm-up generation done)."""
        try:
            return self._http.get("/ready").status_code == 200
        except httpx.HTTPError:
            return False

    def model_card(self) -> dict:
        """The served model's /v1/models entry (id, max_model_len)."""
        if self._model_card is None:
            self._model_card = self._request("GET", "/v1/models")["data"][0]
        return self._model_card

    def max_model_len(self) -> int:
        return int(self.model_card()["max_model_len"])

    def count_tokens(self, prompt: str) -> int:
        """The server's token count for a completion prompt (no chat template)."""
        return int(self._request("POST", "/tokenize", {"prompt": prompt})["count"])

    def engine_cpu_seconds(self) -> float | None:
        """The engine process's CPU time so far (its /metrics), None when it does not say."""
        try:
            response = self._http.get("/metrics")
        except httpx.HTTPError:
            return None
        for line in response.text.splitlines() if response.status_code == 200 else []:
            if line.startswith(ENGINE_CPU_METRIC + " "):
                return float(line.split()[1])
        return None

    # -- streamed completions -------------------------------------------------------------------
    def complete(
        self,
        prompt: str,
        *,
        max_tokens: int,
        method: Method,
        temperature: float = 0.0,
        seed: int | None = 0,
        cache_prompt: bool = True,
    ) -> Completion:
        """Stream one completion and time it (see the module docstring for the definitions)."""
        request = CompletionRequest(prompt, max_tokens, method, temperature, seed, cache_prompt)
        return self.with_reasoning(request, self.run(self.stream(request)))

    async def stream(self, request: CompletionRequest, origin: float | None = None) -> Completion:
        """Stream one completion on the client's loop; `origin`: its window's start (the
        sample's start_s is measured from it)."""
        stream, sent = _StreamTally(self.clock), _SentAt(self.clock)
        try:
            async with self.streams().stream(
                "POST", "/v1/completions", json=request.body(), extensions={"trace": sent.trace}
            ) as response:
                if response.status_code != 200:
                    await response.aread()
                    raise DdopsError(
                        self.label,
                        f"/v1/completions answered {response.status_code}: {_why(response)}",
                    )
                async for line in response.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        stream.take(json.loads(line.removeprefix("data: ")), self.label)
        except httpx.HTTPError as exc:
            raise DdopsError(self.label, f"/v1/completions: {exc}") from exc
        done = stream.completion(sent.at, self.clock(), self.label)
        start = sent.at - (sent.at if origin is None else origin)
        return dataclasses.replace(done, sample=dataclasses.replace(done.sample, start_s=start))

    def with_reasoning(self, request: CompletionRequest, done: Completion) -> Completion:
        """`done` with its reasoning tokens counted by the server when the stream did not say
        (a /tokenize request: after the timing, outside any window)."""
        if done.sample.reasoning_tokens is not None:
            return done
        block = reasoning_block(request.prompt, done.text)
        if not block:
            return done
        counted = min(self.count_tokens(block), done.sample.completion_tokens)
        return dataclasses.replace(
            done, sample=dataclasses.replace(done.sample, reasoning_tokens=counted)
        )


def reasoning_block(prompt: str, text: str) -> str | None:
    """The part of `text` that is reasoning: up to and including `</think>` when the prompt
    left a think block open or the text opens one; None when there is no block."""
    if prompt.rfind(THINK_OPEN) > prompt.rfind(THINK_CLOSE):
        start = 0
    elif text.lstrip().startswith(THINK_OPEN):
        start = text.index(THINK_OPEN)
    else:
        return None
    end = text.find(THINK_CLOSE, start)
    return text[start:] if end < 0 else text[start : end + len(THINK_CLOSE)]


class _SentAt:
    """When a request was sent: the call's start, until httpcore's trace says its first header
    is being written (after any wait for a connection and its opening)."""

    HEADERS = ".send_request_headers.started"  # http11.… or http2.…

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.at = clock()
        self.written = False

    async def trace(self, event: str, info: dict) -> None:
        if not self.written and event.endswith(self.HEADERS):
            self.at, self.written = self.clock(), True


class _StreamTally:
    """What a completion stream said, and when its text arrived."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.pieces: list[str] = []
        self.arrivals: list[float] = []  # when each piece of text arrived
        self.first_text: float | None = None
        self.last_text: float | None = None
        self.usage: dict | None = None
        self.speculative: dict = {}
        self.finish_reason: str | None = None

    def take(self, chunk: dict, label: str) -> None:
        if "error" in chunk:
            raise DdopsError(label, f"the stream failed: {chunk['error'].get('message')}")
        for choice in chunk.get("choices") or []:
            if choice.get("text"):
                now = self.clock()
                self.first_text = self.first_text or now
                self.last_text = now
                self.pieces.append(choice["text"])
                self.arrivals.append(now)
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        self.speculative = chunk.get("speculative") or self.speculative
        self.usage = chunk.get("usage") or self.usage

    def completion(self, sent: float, ended: float, label: str) -> Completion:
        if self.usage is None:
            raise DdopsError(label, "the stream ended without its usage chunk")
        first = self.first_text or ended
        sample = Sample(
            prompt_tokens=self.usage["prompt_tokens"],
            completion_tokens=self.usage["completion_tokens"],
            ttft_s=first - sent,
            decode_s=(self.last_text or first) - first,
            e2e_s=ended - sent,
            rounds=int(self.speculative.get("rounds", 0)),
            tau=float(self.speculative.get("mean_acceptance_length") or 0.0),
            cached_tokens=(self.usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
            reasoning_tokens=(self.usage.get("completion_tokens_details") or {}).get(
                "reasoning_tokens"
            ),
            itl_s=self.inter_token_s(self.usage["completion_tokens"]),
            served=served_label(self.speculative),
        )
        return Completion("".join(self.pieces), self.finish_reason, sample)

    def inter_token_s(self, tokens: int) -> list[float]:
        """The gap before each token after the first (its chunk's arrival, less the previous
        token's), rounded to the microsecond."""
        times = [
            at
            for at, count in zip(
                self.arrivals, tokens_per_chunk([len(p) for p in self.pieces], tokens), strict=True
            )
            for _ in range(count)
        ]
        return [round(b - a, 6) for a, b in zip(times, times[1:], strict=False)]


def served_label(speculative: dict) -> str | None:
    """What a response's `speculative` field says was decoded: `ddtree:15`, `ar`; None when the
    server does not say (a vLLM or llama.cpp server)."""
    method, budget = speculative.get("method"), speculative.get("budget")
    if not method:
        return None
    return f"{method}:{budget}" if budget and method in TREE_METHODS else str(method)


def tokens_per_chunk(lengths: list[int], tokens: int) -> list[int]:
    """`tokens` shared out by the chunks' text lengths (largest remainders), each chunk at least
    one while there are tokens enough: the stream's chunks, counted per token."""
    if not lengths:
        return []
    floor = 1 if tokens >= len(lengths) else 0
    spare, total = tokens - floor * len(lengths), sum(lengths) or len(lengths)
    shares = [spare * (n or (0 if sum(lengths) else 1)) / total for n in lengths]
    counts = [floor + int(share) for share in shares]
    by_remainder = sorted(range(len(lengths)), key=lambda i: int(shares[i]) - shares[i])
    for i in by_remainder[: tokens - sum(counts)]:
        counts[i] += 1
    return counts


def _why(response: httpx.Response) -> str:
    """The OpenAI error message of a refused request, else the start of its body."""
    try:
        return response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return response.text[:200] or response.reason_phrase
