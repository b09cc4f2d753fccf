"""The bench's load: a window of requests sent by N clients at once, closed or open loop.

    window = Window(requests, concurrency=4)                        # closed loop
    window = Window(requests, concurrency=4, rate=2.0, seed=7)      # Poisson arrivals, 2 a second
    sent = window.run(client)          # [Completion] in request order, each sample's start_s set
    sent.wall_s, sent.client_cpu       # the window's length; the bench's own CPU over it

Closed loop (vLLM's `--max-concurrency`, guidellm's concurrent profile): `concurrency` clients,
each taking the next request of the list as soon as its last one has finished. Open loop
(`rate`): request i is sent at the i-th arrival of a Poisson process of `rate` a second (the
gaps drawn from `random.Random(seed)`, so every method of a repeat gets the same arrivals), with
at most `concurrency` in flight. Every stream runs on the client's one event loop
(ops/bench/client.py), each event parsed as it arrives.

The bench's own CPU over the window (`client_cpu`: this process's CPU seconds over the wall
seconds, 1.0 = one core) says whether the load generator could keep up: one event loop is one
core at most, and above CLIENT_SATURATED of it the client, not the server, may set the pace.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from ops.bench.client import Completion, CompletionRequest, EngineClient

CLIENT_SATURATED = 0.8  # of one core: the client's event loop may be what limits the window

Sleep = Callable[[float], Awaitable[None]]


@dataclass(frozen=True)
class Sent:
    """A window's completions (request order) and what the window cost."""

    completions: list[Completion]
    wall_s: float  # first send -> last stream end
    client_cpu: float | None  # this process's CPU over the window, in cores

    @property
    def client_saturated(self) -> bool:
        return self.client_cpu is not None and self.client_cpu > CLIENT_SATURATED


def poisson_offsets(count: int, rate: float, seed: int) -> list[float]:
    """When each of `count` requests arrives, seconds from the first (which arrives at 0)."""
    rng, at, offsets = random.Random(seed), 0.0, []
    for _ in range(count):
        offsets.append(at)
        at += rng.expovariate(rate)
    return offsets


@dataclass(frozen=True)
class Window:
    """What one window sends (see the module docstring)."""

    requests: Sequence[CompletionRequest]
    concurrency: int = 1
    rate: float | None = None
    seed: int = 0
    sleep: Sleep = field(default=asyncio.sleep, compare=False)  # tests: the scripted clock's
    cpu_clock: Callable[[], float] = field(default=time.process_time, compare=False)

    def run(self, client: EngineClient) -> Sent:
        cpu_before, wall_before = self.cpu_clock(), time.perf_counter()
        origin = client.clock()
        completions = client.run(self._send_all(client, origin))
        wall = max((c.sample.start_s + c.sample.e2e_s for c in completions), default=0.0)
        real_wall = time.perf_counter() - wall_before
        cpu = (self.cpu_clock() - cpu_before) / real_wall if real_wall > 0 else None
        completions = [
            client.with_reasoning(request, done)
            for request, done in zip(self.requests, completions, strict=True)
        ]
        return Sent(completions, wall, cpu)

    async def _send_all(self, client: EngineClient, origin: float) -> list[Completion]:
        done: list[Completion | None] = [None] * len(self.requests)
        if self.rate is None:
            await self._closed_loop(client, origin, done)
        else:
            await self._open_loop(client, origin, done)
        return [c for c in done if c is not None]

    async def _closed_loop(self, client, origin: float, done: list) -> None:
        queue = list(range(len(self.requests)))[::-1]

        async def one_client() -> None:
            while queue:
                index = queue.pop()
                done[index] = await client.stream(self.requests[index], origin)

        await _all(one_client() for _ in range(min(self.concurrency, len(self.requests))))

    async def _open_loop(self, client, origin: float, done: list) -> None:
        in_flight = asyncio.Semaphore(self.concurrency)
        offsets = poisson_offsets(len(self.requests), self.rate, self.seed)

        async def arrive(index: int) -> None:
            async with in_flight:
                done[index] = await client.stream(self.requests[index], origin)

        tasks = []
        for index, offset in enumerate(offsets):
            await self.sleep(max(0.0, origin + offset - client.clock()))
            tasks.append(asyncio.ensure_future(arrive(index)))
        await _all(tasks)


async def _all(awaitables) -> None:
    """Await every one; the first failure cancels the rest and propagates."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
