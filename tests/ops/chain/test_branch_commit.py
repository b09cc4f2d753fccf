"""branch_commit: what a ref's branch points at on the hub now, asked by health and recover."""

from __future__ import annotations

import socket
import time

from ops.chain import stage_model
from ops.chain.stage_model import branch_commit
from ops.site.inventory import ModelRef


def test_a_hub_that_accepts_and_never_answers_gives_none_within_the_timeout(monkeypatch):
    monkeypatch.setattr(stage_model, "BRANCH_TIMEOUT_S", 0.5)
    with socket.socket() as stalled:
        stalled.bind(("127.0.0.1", 0))
        stalled.listen(4)  # connections are accepted by the kernel, never answered
        endpoint = f"http://127.0.0.1:{stalled.getsockname()[1]}"
        started = time.monotonic()
        assert branch_commit(ModelRef("org/model", "main", "target"), endpoint, None) is None
        assert time.monotonic() - started < 10


def test_a_commit_revision_is_its_own_answer_without_the_hub():
    sha = "0123456789abcdef0123456789abcdef01234567"
    assert branch_commit(ModelRef("org/model", sha, "target"), "http://127.0.0.1:9", None) == sha
