"""`ddops bench --ct 200` on a provisioned simulated site (real LXC CT, tiny model pair from a
local hub): the preflight is the health chain, a failing check is recovered first (or, with
--no-recover, is the error), then the matrix runs against the CT's engine.

    python -m pytest -q --slow tests/integration/test_bench_site.py
"""

from __future__ import annotations

import pytest

from ops.sim import faults
from tests.helpers.site import make_tiny_hub_root, sim_site

pytestmark = [pytest.mark.lxc, pytest.mark.slow]

SMALL_MATRIX = ("--methods", "ar,ddtree:4", "--lengths", "8", "--warmup", "0")


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    hub_root = make_tiny_hub_root(tmp_path_factory.mktemp("hub"))
    with sim_site(tmp_path_factory.mktemp("site"), hub_root) as site:
        code, document = site.ddops("provision", "--ct", "200")
        assert code == 0, document
        yield site


def modes(document: dict) -> list[tuple[str, bool]]:
    return [(report["mode"], report["ok"]) for report in document["preflight"]]


def test_a_healthy_ct_is_benched_after_the_health_chain(site, tmp_path):
    code, document = site.ddops("bench", "--ct", "200", *SMALL_MATRIX, "--out", str(tmp_path))
    assert code == 0, document
    assert modes(document) == [("health", True)]
    assert document["target"] == f"CT 200 on sim:{site.root}"
    assert document["state"] == "complete"
    assert [r["method"] for r in document["rows"]] == ["ar", "ddtree:4"]
    assert all(r["e2e_tok_s"] > 0 for r in document["rows"])


def test_a_failing_check_is_recovered_first_unless_no_recover(site, tmp_path):
    faults.remove_host_node(site.root, "nvidia-uvm")
    code, output = site.ddops("bench", "--ct", "200", *SMALL_MATRIX, "--no-recover")
    assert code == 1
    assert "Error: CT 200: not healthy:" in output and "nvidia-uvm is missing" in output

    code, document = site.ddops("bench", "--ct", "200", *SMALL_MATRIX, "--out", str(tmp_path))
    assert code == 0, document
    assert modes(document) == [("health", False), ("recover", True)]
    assert document["state"] == "complete" and len(document["rows"]) == 2
