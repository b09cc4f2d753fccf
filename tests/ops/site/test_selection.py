"""Which site and containers a command acts on (ops/site/selection.py): -i, --host, and the sim default.

python -m pytest -q tests/ops/site/test_selection.py
"""

from __future__ import annotations

import sys

import httpx
import pytest
import yaml
from click.testing import CliRunner

from ops.cli import cli
from ops.commands.shared import sim_default_site
from ops.errors import DdopsError
from ops.sim import hubservice
from ops.sim.host import destroy_host, init_host, reboot_host
from ops.site.selection import open_site
from tests.helpers.site import inventory_document


@pytest.fixture
def sim_root(tmp_path):
    root = tmp_path / "pve"
    init_host(root, containers="process")
    yield root
    destroy_host(root)


def write_inventory(tmp_path, sim_root) -> str:
    document = inventory_document(sim_root, "http://127.0.0.1:9")
    document["all"]["hosts"]["other"] = {
        "ansible_host": "192.0.2.7",
        "ddops_containers": [{"vmid": 300}],
    }
    path = tmp_path / "site.yml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return str(path)


def test_an_inventory_gives_every_container_or_the_named_ones(tmp_path, sim_root):
    inventory = write_inventory(tmp_path, sim_root)
    with open_site(inventory=inventory, host=None) as opened:
        assert [(t.host.name, t.ct.vmid) for t in opened.targets] == [("pve", 200), ("other", 300)]
        assert opened.inventory_path == inventory
        assert opened.targets[0].t.label == f"sim:{sim_root}"
        assert opened.targets[1].t.label == "ssh://root@192.0.2.7"  # not connected: lazy
    with open_site(inventory=inventory, host=f"sim:{sim_root}", vmids=[200]) as opened:
        assert [t.ct.vmid for t in opened.targets] == [200]


def test_host_and_ct_outside_the_inventory_are_named(tmp_path, sim_root):
    inventory = write_inventory(tmp_path, sim_root)
    with (
        pytest.raises(DdopsError, match="host 'pve9': not in the inventory"),
        open_site(inventory=inventory, host="pve9"),
    ):
        pass
    with (
        pytest.raises(DdopsError, match="CT 201: not in the inventory"),
        open_site(inventory=inventory, host=None, vmids=[201]),
    ):
        pass


def test_without_inventory_only_a_sim_host_has_a_default_site(sim_root):
    with (
        pytest.raises(DdopsError, match="only sim:PATH hosts have a default site"),
        open_site(inventory=None, host="local", vmids=[200], default_site=sim_default_site),
    ):
        pass
    with (
        pytest.raises(DdopsError, match="name the container with --ct"),
        open_site(inventory=None, host=f"sim:{sim_root}", default_site=sim_default_site),
    ):
        pass
    with (  # a caller without a default site (the selection never imports the sim)
        pytest.raises(DdopsError, match="only sim:PATH hosts have a default site"),
        open_site(inventory=None, host=f"sim:{sim_root}", vmids=[200]),
    ):
        pass
    result = CliRunner().invoke(cli, ["health", "--ct", "200"])
    assert result.exit_code == 1
    assert result.stderr.startswith("Error: ddops: name the site: -i INVENTORY")


def fake_demo_pair(tmp_path, monkeypatch):
    demo = tmp_path / "demo_model"
    for part in ("target", "draft"):
        (demo / part).mkdir(parents=True)
        (demo / part / "config.json").write_text(f'{{"part": "{part}"}}')
    monkeypatch.setattr(hubservice, "DEMO_MODEL_DIR", demo)


def test_the_sim_default_site_serves_the_demo_pair_from_the_hosts_own_hub(
    tmp_path, sim_root, monkeypatch
):
    """The hub belongs to the simulated host: one address for good, so the host's site file
    (written by provision, read at boot) names a hub that is there on every run and reboot."""
    fake_demo_pair(tmp_path, monkeypatch)
    host = f"sim:{sim_root}"
    with open_site(
        inventory=None, host=host, vmids=[200, 201], default_site=sim_default_site
    ) as opened:
        model, engine = opened.site.model, opened.site.engine
        assert [t.ct.vmid for t in opened.targets] == [200, 201]
        assert (engine.python, engine.device, engine.dtype) == (sys.executable, "cpu", "float32")
        assert (model.target.name, model.draft.name) == ("target", "draft")
    config = httpx.get(
        f"{model.hub_endpoint}/{model.draft.repo}/resolve/main/config.json", timeout=10
    )  # the hub outlives the command: it is the host's
    assert config.json() == {"part": "draft"}
    reboot_host(sim_root)
    with open_site(inventory=None, host=host, vmids=[200], default_site=sim_default_site) as again:
        assert again.site.model.hub_endpoint == model.hub_endpoint
    assert httpx.get(f"{model.hub_endpoint}/api/models/{model.target.repo}", timeout=10).is_success
    assert hubservice.stop_hub(sim_root)
    with pytest.raises(httpx.ConnectError):
        httpx.get(model.hub_endpoint, timeout=2)


def test_the_sim_default_site_needs_the_demo_pair(tmp_path, sim_root, monkeypatch):
    monkeypatch.setattr(hubservice, "DEMO_MODEL_DIR", tmp_path / "absent")
    with (
        pytest.raises(DdopsError, match="the demo model pair is not in this checkout"),
        open_site(
            inventory=None, host=f"sim:{sim_root}", vmids=[200], default_site=sim_default_site
        ),
    ):
        pass
