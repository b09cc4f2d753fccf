"""Model staging, the controller's half: run the staging agent (ops/agents/staging.py) in a CT
through `pct exec` over a Transport, and turn its JSON into reports: every model of the CT in
one run of the agent (a Python start in the CT is most of what checking a staged copy costs).

    reports = stage_models(t, 200, [target, draft], python="/opt/ddops/venv/bin/python", endpoint=url)
    staged = check_staged(t, 200, ["target", "draft"], python=..., hashes=False)
    staged["target"].problems, staged["target"].commit  # [] when intact; the commit staged
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


def stage_models(
    t,
    vmid: int,
    refs: list[ModelRef],
    *,
    python: str,
    endpoint: str | None = None,
    token: str | None = None,
    cache: str = CACHE_DIR,
    shm: str = SHM_MODELS,
    refresh: bool = False,
) -> list[StageReport]:
    """Stage the models into the CT's /dev/shm through one `pct exec` (token on stdin, never
    argv), each at the commit staging recorded; `refresh` (provision) moves to the branch's
    commit now. One report per ref, in order."""
    args = ["stage", "--cache", cache, "--shm", shm]
    for ref in refs:
        args += ["--model", ref.name, ref.repo, ref.revision]
    if endpoint:
        args += ["--endpoint", endpoint]
    if refresh:
        args.append("--refresh")
    payload = _run_agent(t, vmid, python, args, env={"HF_TOKEN": token} if token else None)
    return [StageReport(**report) for report in payload["models"]]


@dataclass(frozen=True)
class Staged:
    """The staged copy in a CT: its problems ([] when complete) and the commit it came from."""

    problems: list[str]
    commit: str | None


def check_staged(
    t, vmid: int, names: list[str], *, python: str, shm: str = SHM_MODELS, hashes: bool = False
) -> dict[str, Staged]:
    """The staged copies in the CT, checked through one `pct exec`: name -> Staged."""
    args = ["check", "--shm", shm, *(a for name in names for a in ("--name", name))]
    payload = _run_agent(t, vmid, python, args + (["--hashes"] if hashes else []), timeout=600)
    return {m["name"]: Staged(m["problems"], m.get("commit")) for m in payload["models"]}


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
