"""The engine worker: one thread that runs generations one at a time, fed by a bounded queue.

The engine decodes one sequence at a time (batch 1), so the HTTP server hands each request to
this worker as a `Job` and awaits its events. A job is an ordinary value: the prompt ids, the
`GenerationConfig`, a `TextAssembler`, a cancel flag, and `emit`, a thread-safe callable the
worker calls with `Delta` (text to show), then `Done` (the GenerationResult) or `Failed`.

- `submit` raises `QueueFull` when `max_waiting` jobs already wait, `ShuttingDown` after a cut
  (the server answers 503).
- Setting `job.cancel` (client gone) makes the running generation stop at its next round
  (`should_stop`), or skips the job if it is still waiting.
- A generation that runs out of memory (CUDA or CPU) fails with a 503 "out_of_memory" `Failed`;
  what it held is released and the worker takes the next job.
- `cut()` (shutdown) stops the running job at its next round and fails it and every waiting one
  with a 503 `Failed` (SHUTTING_DOWN); `stop()` cuts, then joins the thread.

Before taking jobs the thread runs `startup` (load the model, one 1-token generation): `ready`
is set when it succeeded; when it raised, `startup_error` says why and `on_fatal` is called.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.memory_plan import is_out_of_memory
from engine.server.text import TextAssembler

log = logging.getLogger(__name__)

# generate(prompt_ids, cfg, on_tokens=..., should_stop=...) -> GenerationResult: the engine
# with its models bound (see engine.server.app.load_engine).
GenerateFn = Callable[..., Any]


SHUTTING_DOWN = "server shutting down"


class QueueFull(Exception):
    """Every waiting slot is taken."""


class ShuttingDown(Exception):
    """The worker was cut: it takes no more jobs."""


@dataclass(frozen=True)
class Delta:
    text: str


@dataclass(frozen=True)
class Done:
    result: Any  # engine.decode.GenerationResult; None when the job was skipped (cancelled early)
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
    cfg: Any  # engine.decode.GenerationConfig
    text: TextAssembler
    emit: Callable[[Delta | Done | Failed], None]
    cancel: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.monotonic)


_STOP = object()  # queue sentinel


class GenerationWorker:
    """Runs `startup`, then jobs from the queue through `generate`, on one daemon thread."""

    def __init__(self, max_waiting: int) -> None:
        self.max_waiting = max_waiting
        self.ready = threading.Event()
        self.startup_error: str | None = None
        self._jobs: queue.Queue = queue.Queue(maxsize=max_waiting)
        self._generate: GenerateFn | None = None
        self._current: Job | None = None
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def waiting(self) -> int:
        return self._jobs.qsize()

    def start(
        self,
        startup: Callable[[], GenerateFn],
        on_fatal: Callable[[], None] = lambda: None,
    ) -> None:
        """Start the thread; `startup` returns the generate function jobs will run through."""
        self._thread = threading.Thread(
            target=self._main, args=(startup, on_fatal), name="engine-worker", daemon=True
        )
        self._thread.start()

    def submit(self, job: Job) -> None:
        if self._stopping.is_set():
            raise ShuttingDown(SHUTTING_DOWN)
        try:
            self._jobs.put_nowait(job)
        except queue.Full:
            raise QueueFull(f"{self.max_waiting} requests are already waiting") from None

    def cut(self) -> None:
        """Take no more jobs; fail the waiting ones and stop the running one (each a 503)."""
        self._stopping.set()
        current = self._current
        if current is not None:
            current.cancel.set()
        self._fail_waiting_jobs()
        with contextlib.suppress(queue.Full):  # then the thread sees _stopping after its next job
            self._jobs.put_nowait(_STOP)

    def stop(self, timeout: float = 30.0) -> None:
        self.cut()
        if self._thread is not None:
            self._thread.join(timeout)

    def _main(self, startup: Callable[[], GenerateFn], on_fatal: Callable[[], None]) -> None:
        try:
            self._generate = startup()
        except Exception as exc:  # any start-up failure is reported, then fatal
            log.exception("engine start-up failed")
            self.startup_error = f"{type(exc).__name__}: {exc}"
            on_fatal()
            return
        self.ready.set()
        while not self._stopping.is_set():
            job = self._jobs.get()
            if job is _STOP:
                break
            self._current = job
            self._run(job)
            self._current = None
        self._fail_waiting_jobs()

    def _run(self, job: Job) -> None:
        if self._stopping.is_set():
            job.emit(_CUT)
            return
        if job.cancel.is_set():
            job.emit(Done(None))
            return
        queued_s = time.monotonic() - job.submitted
        try:
            result = self._generate(
                job.prompt_ids,
                job.cfg,
                on_tokens=lambda ids: _emit_text(job, job.text.add(ids)),
                should_stop=lambda: job.cancel.is_set() or job.text.stopped,
            )
        except Exception as exc:  # one failed generation must not end the worker
            log.exception("generation failed")
            failed = _failure(exc)
        else:
            failed = None
        if failed is not None:
            if failed.code == "out_of_memory":
                release_memory()  # outside the except block: the traceback holding it is gone
            job.emit(failed)
            return
        if result.finish_reason == "cancelled" and self._stopping.is_set() and not job.text.stopped:
            job.emit(_CUT)  # cut short by the shutdown, not finished
            return
        _emit_text(job, job.text.finish())
        job.emit(Done(result, queued_s))

    def _fail_waiting_jobs(self) -> None:
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            if job is not _STOP:
                job.emit(_CUT)


def _failure(exc: Exception) -> Failed:
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


def _emit_text(job: Job, text: str) -> None:
    if text:
        job.emit(Delta(text))
