"""The default site of a simulated host (`ddops --host sim:PATH ...` without an inventory).

One container per `--ct`, the shipped demo model pair served by the host's own hub
(ops/sim/hubservice.py: its address is the host's, so the site file provision writes on the host
stays true across runs and reboots), and the engine on this Python (float32 on the CPU). The CLI
hands `default_site` to ops/site/selection.py, which never imports the sim itself.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from ops.host.targets import parse_target
from ops.sim.hubservice import DEMO_REPOS, ensure_hub
from ops.site.inventory import ContainerSpec, EngineSpec, HostSpec, ModelRef, ModelSpec, Site

DEMO_ENGINE = {"method": "ddtree", "budget": 15, "max_model_len": 2048}


def default_site(host: str, vmids: Sequence[int]) -> Site:
    """The site of sim host `host` (`sim:PATH`) with the containers `vmids`."""
    root = Path(parse_target(host).sysroot)
    model = ModelSpec(
        target=ModelRef(DEMO_REPOS["target"], name="target"),
        draft=ModelRef(DEMO_REPOS["draft"], name="draft"),
        hub_endpoint=ensure_hub(root),
    )
    engine = EngineSpec(**DEMO_ENGINE, dtype="float32", device="cpu", python=sys.executable)
    containers = tuple(ContainerSpec(vmid) for vmid in vmids)
    return Site((HostSpec("sim", host, containers),), model, engine)
