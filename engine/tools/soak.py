"""Soak a running server with mixed requests (issue 36's Done-when): errors, memory, and greedy
outputs against the same request served alone.

    python -m engine.tools.soak --url http://127.0.0.1:8000 --pid PID [--requests 2000] \\
        [--concurrency 8] [--max-tokens 24] [--long-tokens 3000] [--replay 40] \\
        [--methods default,ar,ddtree] [--api-key KEY | env DDOPS_API_KEY]

Request i is KINDS[i % len(KINDS)] (chat, chat with a tool, chat with a JSON-schema
response_format, a completion, a ~--long-tokens chat prompt, a sampled chat, a chat cancelled
after its first chunks), streamed every other cycle (the cancelled one always), over the
--methods in turn ("default": the server's); greedy but the sampled kind (seeded). Each prompt
is its own (the index is in it), so none repeats another's answer.

Reported: HTTP statuses; server errors (5xx, transport or in-stream errors: must be 0); the
server's resident memory (VmRSS of --pid) sampled every second, the mean of the first quarter
of the samples against the last quarter's; `ddops_engine_preemptions_total` gained over the run
(from /metrics); and for --replay greedy requests spread over the run, sent again one at a
time afterwards, whether each answer (text, tool calls) equals the one served under load.
Exit 0 when there were no server errors and every replay matched.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

from engine.server import API_KEY_ENV
from engine.tools.batching import TOPICS, long_prompt
from engine.tools.loadtest import read_rss_kib

KINDS = ("chat", "tools", "json", "completion", "long", "sampled", "cancel")
CANCEL_AFTER_CHUNKS = 3
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string", "maxLength": 12}, "n": {"type": "integer"}},
    "required": ["answer", "n"],
    "additionalProperties": False,
}


@dataclass(frozen=True)
class Planned:
    """One request of the soak: its kind, body and path."""

    index: int
    kind: str
    stream: bool
    body: dict

    @property
    def path(self) -> str:
        return "/v1/completions" if self.kind == "completion" else "/v1/chat/completions"

    @property
    def greedy(self) -> bool:
        return self.kind not in ("sampled", "cancel")


def plan(index: int, args: argparse.Namespace, long_text: str) -> Planned:
    kind = KINDS[index % len(KINDS)]
    stream = kind == "cancel" or (index // len(KINDS)) % 2 == 1
    text = f"Request {index}. {TOPICS[index % len(TOPICS)]}"
    body: dict = {"max_tokens": args.max_tokens, "temperature": 0, "stream": stream}
    method = args.methods[index % len(args.methods)]
    if method != "default":
        body["speculative"] = {"method": method}
    if kind == "completion":
        body["prompt"] = text
    else:
        content = f"{long_text}\n{text}" if kind == "long" else text
        body["messages"] = [{"role": "user", "content": content}]
    if kind == "tools":
        body["tools"] = [TOOL]
    elif kind == "json":
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "reply", "schema": SCHEMA},
        }
    elif kind == "sampled":
        body.update(temperature=0.8, seed=index)
    if stream:
        body["stream_options"] = {"include_usage": True}
    return Planned(index, kind, stream, body)


@dataclass
class Outcome:
    status: int | str  # the HTTP status, "transport-error" or "stream-error"
    answer: dict | None = None  # text and tool calls (a greedy request's, to replay)


@dataclass
class SoakStats:
    statuses: Counter = field(default_factory=Counter)
    answers: dict[int, dict] = field(default_factory=dict)  # greedy, by request index
    failures: list[str] = field(default_factory=list)
    rss_kib: list[int] = field(default_factory=list)
    done: int = 0

    @property
    def server_errors(self) -> int:
        return sum(n for status, n in self.statuses.items() if _server_error(status))


def _server_error(status: int | str) -> bool:
    return isinstance(status, str) or status >= 500


async def send(client: httpx.AsyncClient, request: Planned) -> Outcome:
    """Send one request; its answer when it succeeded and was not cancelled."""
    try:
        if request.stream:
            return await _streamed(client, request)
        response = await client.post(request.path, json=request.body)
    except httpx.HTTPError as error:
        return Outcome("transport-error", {"error": f"{type(error).__name__}: {error}"})
    if response.status_code != 200:
        return Outcome(response.status_code, {"error": response.text[:200]})
    choice = response.json()["choices"][0]
    if "message" not in choice:
        return Outcome(200, {"text": choice["text"], "tool_calls": []})
    message = choice["message"]
    calls = [
        (call["function"]["name"], call["function"]["arguments"])
        for call in message.get("tool_calls") or []
    ]
    return Outcome(200, {"text": message.get("content") or "", "tool_calls": calls})


async def _streamed(client: httpx.AsyncClient, request: Planned) -> Outcome:
    """A streamed request's text and tool calls as the deltas assemble them; a cancelled kind
    closes the connection after CANCEL_AFTER_CHUNKS chunks (no answer)."""
    text, calls, chunks = [], {}, 0
    async with client.stream("POST", request.path, json=request.body) as response:
        if response.status_code != 200:
            return Outcome(response.status_code, {"error": (await response.aread())[:200]})
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return Outcome("stream-error", {"error": json.dumps(chunk)[:200]})
            chunks += 1
            if request.kind == "cancel" and chunks >= CANCEL_AFTER_CHUNKS:
                return Outcome(200)
            for choice in chunk.get("choices") or []:
                _add_delta(choice, text, calls)
    tool_calls = [(name, "".join(parts)) for _, (name, parts) in sorted(calls.items())]
    return Outcome(200, {"text": "".join(text), "tool_calls": tool_calls})


def _add_delta(choice: dict, text: list[str], calls: dict) -> None:
    if "text" in choice:  # a completion's chunk
        text.append(choice["text"] or "")
        return
    delta = choice.get("delta") or {}
    text.append(delta.get("content") or "")
    for call in delta.get("tool_calls") or []:
        entry = calls.setdefault(call["index"], ["", []])
        function = call.get("function") or {}
        entry[0] = entry[0] or function.get("name") or ""
        entry[1].append(function.get("arguments") or "")


async def preemptions(client: httpx.AsyncClient) -> float:
    """The server's ddops_engine_preemptions_total (0 when it has none)."""
    text = (await client.get("/metrics")).text
    for family in text_string_to_metric_families(text):
        if family.name == "ddops_engine_preemptions":
            return sum(sample.value for sample in family.samples if sample.name.endswith("_total"))
    return 0.0


async def wait_ready(client: httpx.AsyncClient, timeout: float) -> None:
    """Until /ready answers 200 (the model loaded and warmed up)."""
    deadline = time.monotonic() + timeout
    while (await client.get("/ready")).status_code != 200:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the server was not ready within {timeout:g} s")
        await asyncio.sleep(0.2)


async def sample_rss(pid: int, stats: SoakStats, stop: asyncio.Event) -> None:
    while not stop.is_set():
        stats.rss_kib.append(read_rss_kib(pid))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 1.0)


async def soak(args: argparse.Namespace) -> dict:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.concurrency + 2)
    async with httpx.AsyncClient(
        base_url=args.url, headers=headers, timeout=args.timeout, limits=limits
    ) as client:
        await wait_ready(client, args.timeout)
        long_text = await long_prompt(client, args.long_tokens)
        requests = [plan(index, args, long_text) for index in range(args.requests)]
        stats, stop = SoakStats(), asyncio.Event()
        preempted_before = await preemptions(client)
        sampler = asyncio.ensure_future(sample_rss(args.pid, stats, stop)) if args.pid else None
        started = time.perf_counter()
        await _run_all(client, requests, args.concurrency, stats)
        wall = time.perf_counter() - started
        stop.set()
        if sampler is not None:
            await sampler
        preempted = await preemptions(client) - preempted_before
        replays = await _replay(client, requests, stats, args.replay)
    return report(stats, wall, preempted, replays, args)


async def _run_all(client, requests: list[Planned], concurrency: int, stats: SoakStats) -> None:
    pending = iter(requests)

    async def worker() -> None:
        for request in pending:  # one shared iterator: each request is sent once
            outcome = await send(client, request)
            stats.statuses[outcome.status] += 1
            stats.done += 1
            if outcome.status != 200 and len(stats.failures) < 20:
                stats.failures.append(f"#{request.index} {request.kind}: {outcome.answer}")
            elif request.greedy and outcome.answer is not None:
                stats.answers[request.index] = outcome.answer

    await asyncio.gather(*(worker() for _ in range(concurrency)))


async def _replay(client, requests: list[Planned], stats: SoakStats, count: int) -> dict:
    """`count` greedy answers spread over the run, each request sent again alone."""
    answered = sorted(stats.answers)
    chosen = answered[:: max(1, len(answered) // count)][:count] if count else []
    mismatches = []
    for index in chosen:
        alone = await send(client, requests[index])
        if alone.answer != stats.answers[index]:
            mismatches.append(
                {
                    "index": index,
                    "kind": requests[index].kind,
                    "under_load": stats.answers[index],
                    "alone": alone.answer,
                }
            )
    return {
        "replayed": len(chosen),
        "equal": len(chosen) - len(mismatches),
        "mismatches": mismatches,
    }


def report(stats: SoakStats, wall: float, preempted: float, replays: dict, args) -> dict:
    out = {
        "requests": stats.done,
        "concurrency": args.concurrency,
        "wall_s": round(wall, 1),
        "statuses": {str(k): v for k, v in sorted(stats.statuses.items(), key=str)},
        "server_errors": stats.server_errors,
        "preemptions": int(preempted),
        "greedy_replays": replays,
        "failures": stats.failures,
    }
    if len(stats.rss_kib) >= 4:
        quarter = len(stats.rss_kib) // 4
        first, last = stats.rss_kib[:quarter], stats.rss_kib[-quarter:]
        out["rss_mib"] = {
            "first_quarter_mean": round(statistics.fmean(first) / 1024, 1),
            "last_quarter_mean": round(statistics.fmean(last) / 1024, 1),
            "max": round(max(stats.rss_kib) / 1024, 1),
            "samples": len(stats.rss_kib),
        }
    return out


def passed(result: dict) -> bool:
    replays = result["greedy_replays"]
    return result["server_errors"] == 0 and replays["equal"] == replays["replayed"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m engine.tools.soak", description=__doc__)
    parser.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--pid", type=int, help="the server's process id (its VmRSS is sampled)")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--long-tokens", type=int, default=3000, help="the long kind's prompt")
    parser.add_argument("--replay", type=int, default=40, help="greedy requests replayed alone")
    parser.add_argument("--methods", default="default,ar,ddtree")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument("--api-key", default=os.environ.get(API_KEY_ENV))
    args = parser.parse_args(argv)
    if min(args.requests, args.concurrency, args.max_tokens, args.long_tokens) < 1:
        parser.error("--requests, --concurrency, --max-tokens and --long-tokens must be >= 1")
    args.methods = args.methods.split(",")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = asyncio.run(soak(args))
    print(json.dumps(result, indent=2))
    return 0 if passed(result) else 1


if __name__ == "__main__":
    sys.exit(main())
