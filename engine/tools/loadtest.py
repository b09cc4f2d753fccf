"""Soak test of a running engine server: many mixed requests at a fixed concurrency.

    python -m engine.tools.loadtest --url http://127.0.0.1:8000 --requests 2000 --concurrency 8 \\
        [--pid PID] [--max-tokens 8] [--methods ar,linear,ddtree] [--api-key KEY | env DDOPS_API_KEY]

Requests cycle through completions and chat completions, streamed and not, over the given
speculative methods. It reports status counts (any 5xx or transport error fails the run), latency
percentiles, throughput, and, with --pid, the server's resident memory (VmRSS from
/proc/PID/status) sampled after a warm-up and every 100 requests: the run fails when memory grows
by more than --max-rss-growth-mib between the first and the last sample. Exit 0 when clean.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from engine.server import API_KEY_ENV

WARM_UP_REQUESTS = 50
RSS_SAMPLE_EVERY = 100


@dataclass(frozen=True)
class RequestKind:
    path: str
    stream: bool
    method: str

    def body(self, max_tokens: int, index: int) -> dict:
        text = f"request {index}: tell me about the number {index % 97}"
        common = {
            "max_tokens": max_tokens,
            "temperature": 0 if index % 2 else 0.8,
            "seed": index,
            "stream": self.stream,
            "speculative": {"method": self.method},
        }
        if self.path.endswith("chat/completions"):
            return {"messages": [{"role": "user", "content": text}], **common}
        return {"prompt": text, **common}


@dataclass
class SoakStats:
    statuses: Counter = field(default_factory=Counter)
    latencies_s: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    rss_kib: list[int] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    @property
    def server_errors(self) -> int:
        return sum(
            n for status, n in self.statuses.items() if isinstance(status, str) or status >= 500
        )


def read_rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise ValueError(f"no VmRSS in /proc/{pid}/status")


async def send(client: httpx.AsyncClient, kind: RequestKind, body: dict, stats: SoakStats) -> None:
    started = time.perf_counter()
    try:
        if kind.stream:
            status = await _send_streaming(client, kind.path, body, stats)
        else:
            response = await client.post(kind.path, json=body)
            status = response.status_code
            if status == 200:
                stats.completion_tokens += response.json()["usage"]["completion_tokens"]
    except httpx.HTTPError as exc:
        status = "transport-error"
        stats.failures.append(f"{kind.path}: {type(exc).__name__}: {exc}")
    stats.statuses[status] += 1
    if status == 200:
        stats.latencies_s.append(time.perf_counter() - started)
    elif len(stats.failures) < 20:
        stats.failures.append(f"{kind.path} stream={kind.stream}: HTTP {status}")


async def _send_streaming(client, path: str, body: dict, stats: SoakStats) -> int | str:
    """The HTTP status, or "stream-error" when the server reported an error inside the stream."""
    request_body = {**body, "stream_options": {"include_usage": True}}
    status: int | str = 0
    async with client.stream("POST", path, json=request_body) as response:
        status = response.status_code
        async for line in response.aiter_lines():
            if line.startswith('data: {"error"'):
                status = "stream-error"
            elif line.startswith("data: {") and '"usage"' in line:
                stats.completion_tokens += json.loads(line[6:])["usage"]["completion_tokens"]
    return status


async def soak(args: argparse.Namespace) -> SoakStats:
    kinds = [
        RequestKind(path, stream, method)
        for method in args.methods.split(",")
        for path in ("/v1/completions", "/v1/chat/completions")
        for stream in (False, True)
    ]
    schedule = iter(enumerate(itertools.islice(itertools.cycle(kinds), args.requests)))
    stats = SoakStats()
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.concurrency)
    async with httpx.AsyncClient(
        base_url=args.url, headers=headers, timeout=args.timeout, limits=limits
    ) as client:

        async def worker() -> None:
            for index, kind in schedule:  # one shared iterator: each request is sent once
                await send(client, kind, kind.body(args.max_tokens, index), stats)
                done = sum(stats.statuses.values())
                if args.pid and done >= WARM_UP_REQUESTS and done % RSS_SAMPLE_EVERY == 0:
                    stats.rss_kib.append(read_rss_kib(args.pid))

        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    if args.pid:
        stats.rss_kib.append(read_rss_kib(args.pid))
    return stats


def summary(stats: SoakStats, wall_s: float, args: argparse.Namespace) -> dict:
    latencies = sorted(stats.latencies_s)

    def percentile(q: float) -> float | None:
        return (
            round(latencies[min(len(latencies) - 1, int(q * len(latencies)))], 4)
            if latencies
            else None
        )

    report = {
        "requests": sum(stats.statuses.values()),
        "concurrency": args.concurrency,
        "statuses": {str(k): v for k, v in sorted(stats.statuses.items(), key=str)},
        "server_errors": stats.server_errors,
        "wall_s": round(wall_s, 2),
        "requests_per_s": round(sum(stats.statuses.values()) / wall_s, 2),
        "completion_tokens": stats.completion_tokens,
        "tokens_per_s": round(stats.completion_tokens / wall_s, 2),
        "latency_s": {
            "p50": percentile(0.5),
            "p95": percentile(0.95),
            "p99": percentile(0.99),
            "mean": round(statistics.fmean(latencies), 4) if latencies else None,
        },
        "failures": stats.failures[:20],
    }
    if stats.rss_kib:
        first, last = stats.rss_kib[0], stats.rss_kib[-1]
        report["rss_mib"] = {
            "first": round(first / 1024, 1),
            "last": round(last / 1024, 1),
            "max": round(max(stats.rss_kib) / 1024, 1),
            "growth": round((last - first) / 1024, 1),
            "samples": len(stats.rss_kib),
        }
    return report


def passed(report: dict, max_rss_growth_mib: float) -> bool:
    rss_ok = report.get("rss_mib", {}).get("growth", 0.0) <= max_rss_growth_mib
    return report["server_errors"] == 0 and rss_ok


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m engine.tools.loadtest", description=__doc__)
    parser.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--methods", default="ar,linear,ddtree")
    parser.add_argument("--pid", type=int, help="server process id, to sample its memory")
    parser.add_argument("--max-rss-growth-mib", type=float, default=64.0)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    parser.add_argument("--api-key", default=os.environ.get(API_KEY_ENV))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    stats = asyncio.run(soak(args))
    report = summary(stats, time.perf_counter() - started, args)
    print(json.dumps(report, indent=2))
    return 0 if passed(report, args.max_rss_growth_mib) else 1


if __name__ == "__main__":
    sys.exit(main())
