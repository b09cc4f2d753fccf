"""A generation that runs out of memory answers 503 with a message, and the server keeps serving
(engine/server/worker.py), over a scripted engine served by a real uvicorn on loopback."""

from __future__ import annotations

import httpx
import pytest
import torch

from engine.memory_plan import is_out_of_memory
from tests.helpers.scripted_server import WAIT_S, ScriptedEngine, running


class OutOfMemoryOnce(ScriptedEngine):
    """Raises `error` (once set) on its next generation, then answers as usual."""

    def __init__(self) -> None:
        super().__init__()
        self.error: Exception | None = None

    def generate(self, prompt_ids, cfg, **callbacks):
        if self.error is not None:
            error, self.error = self.error, None
            raise error
        return super().generate(prompt_ids, cfg, **callbacks)


@pytest.mark.parametrize(
    "error",
    [
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        RuntimeError(
            "[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory"
        ),
    ],
    ids=["cuda", "cpu"],
)
def test_out_of_memory_is_a_503_and_the_next_request_is_served(error):
    engine = OutOfMemoryOnce()
    with running(engine) as (url, state):
        assert state.worker.ready.wait(WAIT_S)
        engine.error = error  # the warm-up generation has passed
        body = {"prompt": "hi", "max_tokens": 3}
        failed = httpx.post(url + "/v1/completions", json=body, timeout=WAIT_S)
        assert failed.status_code == 503, failed.text
        assert failed.json()["error"]["code"] == "out_of_memory"
        assert "out of memory" in failed.json()["error"]["message"]
        served = httpx.post(url + "/v1/completions", json=body, timeout=WAIT_S)
        assert served.status_code == 200 and served.json()["choices"][0]["text"] == "Hel"


def test_other_failures_are_not_taken_for_out_of_memory():
    assert not is_out_of_memory(ValueError("prompt does not fit max_len 64"))
    assert is_out_of_memory(MemoryError())
