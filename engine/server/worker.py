"""The engine worker: one thread that owns the engine's loop, fed by a bounded queue.

The HTTP server hands each request to this worker as a `Job` and awaits its events. A job is an
ordinary value: the prompt ids, the `GenerationConfig`, a `TextAssembler`, a cancel flag, and
`emit`, a thread-safe callable the worker calls with `Delta` (text to show), then `Done` (the
GenerationResult) or `Failed`. The thread runs an `EngineLoop` (engine/scheduler.py): the
`Scheduler`, which decodes up to --max-num-seqs sequences at once, a batched pass a step, or a
`SerialLoop` (one generation at a time: tensor parallel, scripted engines). Between steps it
moves jobs from the queue into the loop while the loop has a free slot, so jobs beyond the
slots wait in the queue, first come first served.

- `submit(*jobs)` queues a request's jobs (one per sequence) together, or raises `QueueFull`
  when they would make more than `max_waiting` wait (a request of more sequences than that is
  taken when none wait), `ShuttingDown` after a cut (the server answers 503).
- Setting `job.cancel` (client gone) makes its sequence stop at the next step, or skips the job
  if it is still waiting.
- A generation that runs out of memory (CUDA or CPU) fails with a 503 "out_of_memory" `Failed`;
  what it held is released and the others keep going (engine/scheduler.py says which fail).
- `cut()` (shutdown) stops the running jobs at the next step and fails them and every waiting
  one with a 503 `Failed` (SHUTTING_DOWN); `stop()` cuts, then joins the thread.

Before taking jobs the thread runs `startup` (load the model, one 1-token generation): `ready`
is set when it succeeded; when it raised, `startup_error` says why and `on_fatal` is called.
"""

from __future__ import annotations

import gc
import logging
import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.decode import GenerationConfig, GenerationResult
from engine.memory_plan import is_out_of_memory
from engine.scheduler import EngineLoop, Finished, Request
from engine.server.text import TextAssembler

log = logging.getLogger(__name__)


SHUTTING_DOWN = "server shutting down"


class QueueFull(Exception):
    """Every waiting slot is taken."""


class ShuttingDown(Exception):
    """The worker was cut: it takes no more jobs."""


@dataclass(frozen=True)
class Delta:
    text: str
    logprobs: tuple = ()  # engine.sampling.TokenLogprob of the tokens behind it, when asked


@dataclass(frozen=True)
class Done:
    result: GenerationResult | None  # None when the job was cancelled before its first token
    queued_s: float = 0.0  # how long the job waited for the worker before its generation began

    @property
    def ttft_s(self) -> float:
        """Time to first token as the client sees it: the wait in the queue, then the engine's."""
        return self.queued_s + self.result.ttft_s


@dataclass(frozen=True)
class Failed:
    message: str
    status: int = 500
    code: str | None = None


_CUT = Failed(SHUTTING_DOWN, status=503, code="shutting_down")


@dataclass
class Job:
    prompt_ids: list[int]
    cfg: GenerationConfig
    text: TextAssembler
    emit: Callable[[Delta | Done | Failed], None]
    cancel: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.monotonic)
    logprobs: list = field(default_factory=list)  # the next tokens' (the engine's on_logprobs)
    # Queued when this job ends: its request's other sequences, which then find the prompt in
    # the prefix cache (prefilled once, until sequences share blocks while they run).
    followers: tuple[Job, ...] = ()


_STOP = object()  # queue sentinel


class GenerationWorker:
    """Runs `startup`, then the engine loop it returns over the queue's jobs, on one thread."""

    def __init__(self, max_waiting: int) -> None:
        self.max_waiting = max_waiting
        self.ready = threading.Event()
        self.startup_error: str | None = None
        self._jobs: queue.Queue = queue.Queue()  # bounded by `submit`
        self._loop: EngineLoop | None = None
        self._in_flight_jobs: dict[int, Job] = {}  # the jobs in the loop, by id
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def waiting(self) -> int:
        """Jobs not running yet (in the queue, or in the loop waiting for a slot)."""
        loop_waiting = self._loop.counts[1] if self._loop is not None else 0
        return self._jobs.qsize() + loop_waiting

    @property
    def running(self) -> int:
        return self._loop.counts[0] if self._loop is not None else 0

    def start(
        self,
        startup: Callable[[], EngineLoop],
        on_fatal: Callable[[], None] = lambda: None,
    ) -> None:
        """Start the thread; `startup` returns the engine loop jobs will run in."""
        self._thread = threading.Thread(
            target=self._main, args=(startup, on_fatal), name="engine-worker", daemon=True
        )
        self._thread.start()

    def submit(self, *jobs: Job) -> None:
        """Queue one request's jobs, all or none (their followers counted, queued later)."""
        with self._lock:
            if self._stopping.is_set():
                raise ShuttingDown(SHUTTING_DOWN)
            waiting, count = self.waiting, sum(1 + len(job.followers) for job in jobs)
            if waiting and waiting + count > self.max_waiting:
                raise QueueFull(f"{waiting} requests are already waiting")
            for job in jobs:
                self._jobs.put_nowait(job)

    def cut(self) -> None:
        """Take no more jobs; fail the waiting ones and stop the running ones (each a 503)."""
        self._stopping.set()
        with self._lock:
            running = list(self._in_flight_jobs.values())
        for job in running:
            job.cancel.set()
        self._fail_waiting_jobs()
        self._jobs.put_nowait(_STOP)  # wake the thread if it waits for a job

    def stop(self, timeout: float = 30.0) -> None:
        self.cut()
        if self._thread is not None:
            self._thread.join(timeout)

    def _main(self, startup: Callable[[], EngineLoop], on_fatal: Callable[[], None]) -> None:
        try:
            loop = startup()
        except Exception as exc:  # any start-up failure is reported, then fatal
            log.exception("engine start-up failed")
            self.startup_error = f"{type(exc).__name__}: {exc}"
            on_fatal()
            return
        self._loop = loop
        self.ready.set()
        while not self._stopping.is_set():
            self._take_jobs(loop)
            if not loop.idle:
                loop.step()
        loop.cancel_all()  # what was running ends cut (a 503 each)
        self._fail_waiting_jobs()

    def _take_jobs(self, loop: EngineLoop) -> None:
        """Move queued jobs into the loop while it has room; wait for one when it is idle."""
        block = loop.idle
        while loop.room > 0 and not self._stopping.is_set():
            try:
                job = self._jobs.get() if block else self._jobs.get_nowait()
            except queue.Empty:
                return
            block = False
            if job is _STOP:
                return
            self._start(loop, job)

    def _start(self, loop: EngineLoop, job: Job) -> None:
        if self._stopping.is_set():
            self._end(job, _CUT)
            return
        if job.cancel.is_set():
            self._end(job, Done(None))
            return
        with self._lock:
            self._in_flight_jobs[id(job)] = job
        loop.add(
            Request(
                job.prompt_ids,
                job.cfg,
                on_tokens=lambda ids: _emit_tokens(job, ids),
                should_stop=lambda: job.cancel.is_set() or job.text.stopped,
                on_logprobs=job.logprobs.extend if job.cfg.logprobs is not None else None,
                on_finish=lambda finished: self._finish(job, finished),
            )
        )

    def _finish(self, job: Job, finished: Finished) -> None:
        with self._lock:
            self._in_flight_jobs.pop(id(job), None)
        if finished.error is not None:
            log.error("generation failed: %s", finished.error, exc_info=finished.error)
            failed = _failure(finished.error)
            if failed.code == "out_of_memory":
                release_memory()
            self._end(job, failed)
            return
        result, cut = finished.result, self._stopping.is_set() and not job.text.stopped
        if cut and (result is None or result.finish_reason == "cancelled"):
            self._end(job, _CUT)  # cut short by the shutdown, not finished
            return
        if result is None:
            self._end(job, Done(None))
            return
        _emit_text(job, job.text.finish())
        queued_s = (finished.admitted or job.submitted) - job.submitted
        self._end(job, Done(result, queued_s))

    def _end(self, job: Job, event: Done | Failed) -> None:
        """A job's last event; then its followers are queued (or cut, after a shutdown)."""
        job.emit(event)
        followers, job.followers = job.followers, ()
        with self._lock:
            stopping = self._stopping.is_set()
            if not stopping:
                for follower in followers:
                    self._jobs.put_nowait(follower)
        if stopping:
            for follower in followers:
                follower.emit(_CUT)

    def _fail_waiting_jobs(self) -> None:
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            if job is not _STOP:
                self._end(job, _CUT)


def _failure(exc: BaseException) -> Failed:
    if is_out_of_memory(exc):
        return Failed(
            f"out of memory during this generation ({type(exc).__name__}: {exc}); its memory "
            "was released and the server keeps serving: retry, or ask for fewer tokens",
            status=503,
            code="out_of_memory",
        )
    return Failed(f"generation failed: {type(exc).__name__}: {exc}")


def release_memory() -> None:
    """Give back what a failed generation held: its cache is garbage once its frames are."""
    gc.collect()
    torch = sys.modules.get("torch")  # a scripted engine (tests) runs without torch
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


def _emit_tokens(job: Job, ids: list[int]) -> None:
    """A round's ids as a Delta: their text and the logprobs of those the text holds."""
    before = job.text.taken
    text = job.text.add(ids)
    logprobs = tuple(job.logprobs[: job.text.taken - before])
    job.logprobs.clear()
    if text or logprobs:
        job.emit(Delta(text, logprobs))


def _emit_text(job: Job, text: str) -> None:
    if text:
        job.emit(Delta(text))
