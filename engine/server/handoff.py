"""Events handed from the engine's thread to the event loop of the request that waits for them.

The worker thread calls a job's `emit` with each `Delta`, then `Done` or `Failed`; the request's
handler awaits them on an asyncio queue of its own event loop. Every hand-over wakes that loop
(`call_soon_threadsafe`), and on a busy core each wake takes the core from the engine's thread,
so `thread_safe_put` wakes it as seldom as it can:

- an answer not streamed (`whole`) keeps its Deltas and hands them over with its last event;
- events of every request of one loop go through its `Mailbox`: the first posted while none
  waits wakes the loop, and those posted before it runs (the other sequences' of the same
  engine step) are delivered by that same wake. Each queue still gets its own events in order.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import Callable
from typing import Any

from engine.server.worker import Delta

_MAILBOXES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop -> Mailbox


class Mailbox:
    """Events for the queues of one event loop, delivered in as few wakes of it as possible."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = weakref.ref(loop)  # (a strong one would keep the loop's entry forever)
        self._lock = threading.Lock()
        self._posted: list[tuple[asyncio.Queue, Any]] = []
        self.wakes = 0  # how many times the loop was woken (tests, diagnostics)

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> Mailbox:
        """The loop's mailbox (made on its first use)."""
        mailbox = _MAILBOXES.get(loop)
        if mailbox is None:
            mailbox = _MAILBOXES[loop] = cls(loop)
        return mailbox

    def post(self, events: asyncio.Queue, batch: list[Any]) -> None:
        """Put `batch` into `events` on the loop, from any thread."""
        with self._lock:
            wake = not self._posted
            self._posted.extend((events, event) for event in batch)
            if wake:
                self.wakes += 1
        loop = self._loop()
        if wake and loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        with self._lock:
            posted, self._posted = self._posted, []
        for events, event in posted:
            events.put_nowait(event)


def thread_safe_put(events: asyncio.Queue, whole: bool) -> Callable[[Any], None]:
    """An `emit` for the worker thread that puts into `events` on the running event loop (made
    there). `whole` (an answer not streamed): its Deltas are kept and handed over with its last
    event."""
    mailbox = Mailbox.of(asyncio.get_running_loop())
    held: list[Any] = []
    lock = threading.Lock()  # the last event may come from another thread (a shutdown's cut)

    def put(event: Any) -> None:
        with lock:
            if whole and isinstance(event, Delta):
                held.append(event)
                return
            batch = [*held, event]
            held.clear()
        mailbox.post(events, batch)

    return put
