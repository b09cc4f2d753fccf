"""Model staging, the controller's half: run the staging agent (ops/agents/staging.py) in a CT
through `pct exec` over a Transport, and turn its JSON into a report.

    report = stage_model(t, 200, ref, python="/opt/ddops/venv/bin/python", endpoint=url)
    problems = check_staged(t, 200, "target", python=..., hashes=False)   # [] when intact

The HF token travels on stdin (ct_exec's env), never on a command line.
"""

from __future__ import annotations

import json

from ops.agents.staging import CACHE_DIR, SHM_MODELS, StageReport
from ops.errors import DdopsError
from ops.host.pve import ct_exec
from ops.site.inventory import ModelRef


def _run_agent(
    t, vmid: int, python: str, args: list[str], *, env: dict | None = None, timeout: float = 3600
) -> dict:
    """Run the agent in the CT; its last stdout line is its JSON report."""
    result = ct_exec(t, vmid, [python, "-m", "ops.agents.staging", *args], env=env, timeout=timeout)
    try:
        payload = json.loads(result.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        raise DdopsError(
            f"CT {vmid}", f"staging agent gave no report: {result.stderr.strip()[-300:]}"
        ) from None
    if "error" in payload:
        raise DdopsError(f"CT {vmid}", payload["error"])
    return payload


def stage_model(
    t,
    vmid: int,
    ref: ModelRef,
    *,
    python: str,
    endpoint: str | None = None,
    token: str | None = None,
    cache: str = CACHE_DIR,
    shm: str = SHM_MODELS,
) -> StageReport:
    """Stage one model into the CT's /dev/shm through `pct exec` (token on stdin, never argv)."""
    args = [
        "stage",
        "--repo",
        ref.repo,
        "--revision",
        ref.revision,
        "--name",
        ref.name,
        "--cache",
        cache,
        "--shm",
        shm,
    ]
    if endpoint:
        args += ["--endpoint", endpoint]
    payload = _run_agent(t, vmid, python, args, env={"HF_TOKEN": token} if token else None)
    return StageReport(**payload)


def check_staged(
    t, vmid: int, name: str, *, python: str, shm: str = SHM_MODELS, hashes: bool = False
) -> list[str]:
    """Problems with the staged copy in the CT (empty: complete)."""
    args = ["check", "--name", name, "--shm", shm] + (["--hashes"] if hashes else [])
    return _run_agent(t, vmid, python, args, timeout=600)["problems"]
