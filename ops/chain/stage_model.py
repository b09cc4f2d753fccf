"""Model staging, the controller's half: run the staging agent (ops/agents/staging.py) in a CT
through `pct exec` over a Transport, and turn its JSON into a report.

    report = stage_model(t, 200, ref, python="/opt/ddops/venv/bin/python", endpoint=url)
    staged = check_staged(t, 200, "target", python=..., hashes=False)
    staged.problems, staged.commit                     # [] when intact; the commit staged
    branch_commit(ref, endpoint, token)                # what the ref's branch points at now

The HF token travels on stdin (ct_exec's env), never on a command line.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from ops.agents.staging import CACHE_DIR, SHM_MODELS, StageReport, hub_errors
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
    refresh: bool = False,
) -> StageReport:
    """Stage one model into the CT's /dev/shm through `pct exec` (token on stdin, never argv),
    at the commit staging recorded; `refresh` (provision) moves to the branch's commit now."""
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
    if refresh:
        args.append("--refresh")
    payload = _run_agent(t, vmid, python, args, env={"HF_TOKEN": token} if token else None)
    return StageReport(**payload)


@dataclass(frozen=True)
class Staged:
    """The staged copy in a CT: its problems ([] when complete) and the commit it came from."""

    problems: list[str]
    commit: str | None


def check_staged(
    t, vmid: int, name: str, *, python: str, shm: str = SHM_MODELS, hashes: bool = False
) -> Staged:
    """The staged copy in the CT, checked."""
    args = ["check", "--name", name, "--shm", shm] + (["--hashes"] if hashes else [])
    payload = _run_agent(t, vmid, python, args, timeout=600)
    return Staged(payload["problems"], payload.get("commit"))


COMMIT = re.compile(r"[0-9a-f]{40}")
BRANCH_TIMEOUT_S = 10.0  # health and recover ask on every run: a stalled hub must not hold them


def branch_commit(ref: ModelRef, endpoint: str | None, token: str | None) -> str | None:
    """The commit the ref's revision points at on the hub now (it is the commit itself when the
    revision is one); None when the hub cannot tell (within BRANCH_TIMEOUT_S)."""
    if COMMIT.fullmatch(ref.revision):
        return ref.revision
    from huggingface_hub import HfApi

    try:
        with hub_errors(ref):
            return (
                HfApi(endpoint=endpoint, token=token)
                .model_info(ref.repo, revision=ref.revision, timeout=BRANCH_TIMEOUT_S)
                .sha
            )
    except DdopsError:
        return None
