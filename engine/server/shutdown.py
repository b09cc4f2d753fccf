"""Stopping the engine server: requests in flight get a grace period, then a 503, never a 500.

On SIGTERM uvicorn stops accepting connections, waits `timeout_graceful_shutdown` for the open
ones, then cancels what is left: a cancelled request is a 500 and a traceback in the log.
`DrainingServer` tells the app first (`ServerState.begin_shutdown`): running and waiting generations
go on for `shutdown_grace_s`, then the worker cuts them and each is answered 503 "server shutting
down" (a stream ends with that error event, then `[DONE]`). uvicorn's own timeout comes
CUT_SLACK_S later: a cut generation stops at the end of its current round, and one round (a
long prompt's prefill) may take seconds on a large model.
"""

from __future__ import annotations

import math
import socket
from typing import Any

import uvicorn
from fastapi import FastAPI

CUT_SLACK_S = 30


class DrainingServer(uvicorn.Server):
    """uvicorn, telling the app (`create_app`'s) when shutdown begins."""

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.config.app.state.server.begin_shutdown()
        await super().shutdown(sockets)


def draining_server(app: FastAPI, **config: Any) -> DrainingServer:
    """A server for `app` (from `create_app`); `config`: uvicorn.Config's (host, port, ...)."""
    grace = app.state.server.config.shutdown_grace_s
    timeout = math.ceil(grace) + CUT_SLACK_S
    return DrainingServer(uvicorn.Config(app, timeout_graceful_shutdown=timeout, **config))
