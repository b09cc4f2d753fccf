"""engine/server/handoff.py hands a job's events from the engine's thread to its request's
event loop: a streamed answer's each at once, a whole answer's with its last event (one wake of
the loop, not one every engine step), and the events of many requests posted before the loop
runs in one wake."""

from __future__ import annotations

import asyncio
import gc
import threading
import weakref

import pytest

from engine.server.handoff import Mailbox, thread_safe_put
from engine.server.worker import Delta, Done, Failed


def _deliveries(whole: bool, last: Done | Failed) -> tuple[int, list]:
    """How many events the loop held after two Deltas from another thread, then every event
    once `last` came too."""

    async def run() -> tuple[int, list]:
        events: asyncio.Queue = asyncio.Queue()
        put = thread_safe_put(events, whole)
        engine = threading.Thread(target=lambda: [put(Delta("a")), put(Delta("b"))])
        engine.start()
        engine.join()
        await asyncio.sleep(0.05)  # the loop runs what was handed to it
        early = events.qsize()
        threading.Thread(target=put, args=(last,)).start()
        return early, [await asyncio.wait_for(events.get(), 5) for _ in range(3)]

    return asyncio.run(run())


@pytest.mark.parametrize("last", [Done(None), Failed("boom")])
def test_a_streamed_answer_gets_each_delta_as_it_comes(last):
    early, events = _deliveries(whole=False, last=last)
    assert early == 2
    assert events == [Delta("a"), Delta("b"), last]


@pytest.mark.parametrize("last", [Done(None), Failed("boom")])
def test_a_whole_answer_gets_its_deltas_with_its_last_event_in_order(last):
    early, events = _deliveries(whole=True, last=last)
    assert early == 0
    assert events == [Delta("a"), Delta("b"), last]


def test_the_events_of_many_requests_posted_before_the_loop_runs_take_one_wake():
    """Six streamed requests' Deltas of one engine step (posted while the loop is busy) wake it
    once; each queue gets its own, in order."""

    async def run() -> tuple[int, list[list]]:
        queues = [asyncio.Queue() for _ in range(6)]
        puts = [thread_safe_put(events, whole=False) for events in queues]
        mailbox = Mailbox.of(asyncio.get_running_loop())
        before = mailbox.wakes

        def step(number: int) -> None:
            for index, put in enumerate(puts):
                put(Delta(f"{number}:{index}"))

        for number in range(2):  # two steps, the loop busy here all the while
            engine = threading.Thread(target=step, args=(number,))
            engine.start()
            engine.join()
        woken = mailbox.wakes - before
        got = [[await asyncio.wait_for(q.get(), 5) for _ in range(2)] for q in queues]
        return woken, got

    woken, got = asyncio.run(run())
    assert woken == 1
    assert got == [[Delta(f"0:{i}"), Delta(f"1:{i}")] for i in range(6)]


def test_a_finished_event_loops_mailbox_goes_with_it():
    loops = []

    async def serve_one() -> None:
        loops.append(weakref.ref(asyncio.get_running_loop()))
        thread_safe_put(asyncio.Queue(), whole=False)(Delta("a"))
        await asyncio.sleep(0)

    asyncio.run(serve_one())
    gc.collect()
    assert loops[0]() is None  # nothing keeps the loop, nor so its mailbox
