"""The simulated host's own hub: a local Hugging Face hub (ops/sim/hub.py) that belongs to the host.

A default site (`ddops --host sim:PATH ...` without an inventory) and the demo stage their models
from it. Its address is the host's, fixed when the host is made (`ddops sim init`), so the site
file ddops writes on the host (`/etc/ddops/site.yml`, read by the boot-time recovery) names a hub
that is there on every run and after every reboot, like a mirror on the host's own network.

    ensure_hub(root)     # its URL; starts it (a detached process) when it does not run
    stop_hub(root)       # `ddops sim destroy` does
    bytes_served(root)   # file bytes it has served over the host's life (the demo's "0 downloaded")

Its repos live below the host (PATH/var/lib/ddops-sim/hub/<org>/<name>, links to the shipped demo
model pair); a reboot of the host restarts it when it ran before.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from ops.errors import DdopsError
from ops.sim.hub import served_before
from ops.sim.state import load_state, log, save_state

HUB_DIR = "var/lib/ddops-sim/hub"
PIDFILE = "var/lib/ddops-sim/hub.pid"
STATS_FILE = "var/lib/ddops-sim/hub.json"
LOG_FILE = "var/log/ddops-sim-hub.log"
HUB_MODULE = "ops.sim.hub"
START_TIMEOUT_S = 15.0
STOP_TIMEOUT_S = 5.0
DEMO_MODEL_DIR = Path(__file__).resolve().parents[2] / "engine" / "demo_model"
DEMO_REPOS = {"target": "ddops/demo-target", "draft": "ddops/demo-draft"}


def free_port() -> int:
    """A loopback port free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def hub_url(root: Path) -> str:
    """The host's hub address (fixed at `sim init`; an older host gets one now)."""
    state = load_state(root)
    if not state.hub_port:
        state.hub_port = free_port()
        save_state(root, state)
    return f"http://127.0.0.1:{state.hub_port}"


def link_demo_repos(root: Path) -> Path:
    """The hub's repos: links to the shipped demo model pair (DdopsError when it is not there)."""
    model_dir = DEMO_MODEL_DIR
    if not all((model_dir / part / "config.json").is_file() for part in DEMO_REPOS):
        raise DdopsError(str(model_dir), "the demo model pair is not in this checkout: use -i")
    hub = root / HUB_DIR
    for part, repo in DEMO_REPOS.items():
        link = hub / repo
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink() and link.resolve() != (model_dir / part).resolve():
            link.unlink()
        if not link.is_symlink():
            link.symlink_to(model_dir / part)
    return hub


def running_pid(root: Path) -> int | None:
    """The hub's pid when it runs (its pidfile names a live hub process of this host)."""
    try:
        pid = int((root / PIDFILE).read_text())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ValueError):
        return None
    return pid if HUB_MODULE.encode() in cmdline and str(root).encode() in cmdline else None


def ensure_hub(root: Path) -> str:
    """The host's hub URL, starting the hub when it does not run."""
    url = hub_url(root)
    if running_pid(root) is not None:
        return url
    port = int(url.rsplit(":", 1)[1])
    hub = link_demo_repos(root)
    (root / LOG_FILE).parent.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", HUB_MODULE, str(hub), "--port", str(port)]
    argv += ["--stats", str(root / STATS_FILE)]
    with open(root / LOG_FILE, "ab") as out:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True
        )
    (root / PIDFILE).write_text(f"{proc.pid}\n")
    deadline = time.monotonic() + START_TIMEOUT_S
    while not _answers(port):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise DdopsError(
                f"sim:{root}", f"its hub did not start on 127.0.0.1:{port} (see {root / LOG_FILE})"
            )
        time.sleep(0.05)
    log(root, f"hub serving {hub} on {url} (pid {proc.pid})")
    return url


def stop_hub(root: Path) -> bool:
    """Stop the host's hub; whether one ran."""
    pid = running_pid(root)
    (root / PIDFILE).unlink(missing_ok=True)
    if pid is None:
        return False
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while not _exited(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return True


def _exited(pid: int) -> bool:
    """Whether the hub process has ended: reaped here when it is this process's child (the demo
    starts the hub in its own process), or gone, or a zombie its parent has not reaped yet. A
    zombie's /proc entry stays: waiting for it to vanish cost every in-process reboot 5 s."""
    with contextlib.suppress(ChildProcessError):
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[-1].split()[0] == "Z"  # the state follows "(comm)"


def bytes_served(root: Path) -> int:
    """File bytes the hub has served over the host's life (0 when it never did)."""
    return served_before(root / STATS_FILE)


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False
