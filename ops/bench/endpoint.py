"""Where the bench sends its requests, after the preflight: a plain URL, or a site's CT.

    with site_endpoint(app, vmid=200, results=Path("results"), recover_first=True) as endpoint:
        endpoint.url          # http://127.0.0.1:8000, or a local SSH tunnel's URL
        endpoint.preflight    # the health (and recover) reports, as JSON
    with url_endpoint("http://127.0.0.1:8000", api_key) as endpoint: ...
    endpoint.api_key      # the key to send: the CT's own (read from the CT), or the one given
    endpoint.read_text, endpoint.run   # the engine machine's /proc and nvidia-smi (or None)

The CT preflight is the recover chain (ops/chain/runner.py): health first; when a check fails,
`recover` (unless recover_first is False, then the failure is the error) and the CT must end
healthy. Check 10 of that chain quarantines stale runs of the results directory. A URL endpoint
only requires the engine's /ready: that is the seam tests use against a plain local server.

The machine's state (engine.machine_state) is read where the engine runs: a site's host through
its transport (`cat /proc/...` and `nvidia-smi` over SSH; on a local or simulated host /proc is
this machine's, since the CTs run here, and nvidia-smi is the host's, the sim's on a sim host);
a URL on this machine (loopback) here; a URL elsewhere not at all.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from engine.machine_state import ReadText, Run, local_read, local_run
from ops.bench.client import EngineClient
from ops.chain.deploy import installed_api_key
from ops.errors import DdopsError
from ops.host.ssh import SSHTransport
from ops.host.transport import Transport

LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")


@dataclass(frozen=True)
class Endpoint:
    url: str
    target: str  # what is benched, in words: "CT 200 on sim:/tmp/pve1" or the URL
    preflight: list[dict] = field(default_factory=list)
    api_key: str | None = field(default=None, repr=False)  # the key the engine requires
    read_text: ReadText | None = field(default=None, repr=False, compare=False)
    run: Run | None = field(default=None, repr=False, compare=False)

    @property
    def here(self) -> bool:
        """The engine runs on this machine (so the bench's own CPU time is the machine's too)."""
        return self.read_text is local_read


@contextlib.contextmanager
def url_endpoint(url: str, api_key: str | None = None) -> Iterator[Endpoint]:
    """An engine at a URL; DdopsError unless its /ready answers 200."""
    with EngineClient(url, api_key, timeout=10) as client:
        if not client.ready():
            raise DdopsError(client.label, "not ready: /ready does not answer 200")
    local = httpx.URL(url).host in LOOPBACK
    yield Endpoint(
        url.rstrip("/"),
        url.rstrip("/"),
        api_key=api_key,
        read_text=local_read if local else None,
        run=local_run if local else None,
    )


def transport_readers(t: Transport) -> tuple[ReadText, Run]:
    """The engine machine's /proc and commands, for a site's host."""

    def run(argv) -> str:
        result = t.run(list(argv), timeout=15)
        if not result.ok:
            raise RuntimeError(f"{argv[0]} exited {result.rc}")
        return result.stdout

    if isinstance(t, SSHTransport):
        return (lambda path: run(["cat", path])), run
    return local_read, run  # a local or simulated host: its CTs run on this machine


@contextlib.contextmanager
def site_endpoint(
    app, *, vmid: int, results: Path, recover_first: bool = True
) -> Iterator[Endpoint]:
    """The engine of CT `vmid` of the CLI's site (`app`: ops.commands.shared.AppContext), after the chain."""
    from ops.chain.runner import contexts, run_chain

    with app.open_site([vmid]) as opened:
        chain = dataclasses.replace(contexts(opened)[0], results_dir=results)
        reports = [run_chain(chain, mode="health")]
        if not reports[-1].ok and recover_first:
            reports.append(run_chain(chain, mode="recover"))
        if not reports[-1].ok:
            failed = next(r for r in reports[-1].results if r.status == "failed")
            advice = "run `ddops recover`" if not recover_first else "recover could not fix it"
            raise DdopsError(chain.name, f"not healthy: {failed.evidence} ({advice})")
        preflight = [report.to_json() for report in reports]
        target = f"{chain.name} on {chain.t.label}"
        api_key = installed_api_key(chain.t, vmid)  # the CT's key is the truth, not the caller's
        read_text, run = transport_readers(chain.t)
        with _engine_url(chain) as url:
            yield Endpoint(url, target, preflight, api_key, read_text, run)


@contextlib.contextmanager
def _engine_url(chain) -> Iterator[str]:
    """The engine listens on 127.0.0.1 in the CT: direct on a local or simulated host (its CTs
    share the host's network), through an SSH tunnel on a remote one."""
    if not isinstance(chain.t, SSHTransport):
        yield f"http://127.0.0.1:{chain.engine.port}"
        return
    from ops.bench.tunnel import engine_tunnel

    with engine_tunnel(
        chain.t, vmid=chain.vmid, python=chain.engine.python, port=chain.engine.port
    ) as forward:
        yield forward.url
