"""Exact revisions on a provisioned sim host (real LXC): staging records the commit `main`
resolved to; when main moves, health says an upgrade is available and changes nothing, recover
repairs from the staged commit, and provision moves to the new one.

    python -m pytest -q --slow tests/integration/test_revisions.py
"""

from __future__ import annotations

import pytest

from tests.helpers.site import TARGET_REPO, check_of, make_tiny_hub_root, sim_site, statuses

pytestmark = [pytest.mark.lxc, pytest.mark.slow]


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    hub_root = make_tiny_hub_root(tmp_path_factory.mktemp("hub"))  # this module's: main moves
    with sim_site(tmp_path_factory.mktemp("site"), hub_root) as site:
        code, document = site.ddops("provision", "--ct", "200")
        assert code == 0, document
        yield site


def test_main_moves_health_tells_recover_keeps_provision_upgrades(site):
    staged = site.shm_digests("target")
    (site.hub.root / TARGET_REPO / "notes.md").write_text("a new commit on main\n")  # main moves

    before = site.file_state()
    code, document = site.ddops("health", "--ct", "200")
    assert code == 0, document
    evidence = check_of(document, "model")["evidence"]
    assert f"upgrade available: {TARGET_REPO} main is at " in evidence
    assert site.file_state() == before  # health changes nothing

    site.ct_sh("rm -rf /dev/shm/models")
    site.ct_sh(  # and the cached weights are damaged: the repair must fetch the staged commit
        "for f in /var/cache/ddops/hf/models--ddops--tiny-target/blobs/*; do "
        '[ $(stat -c %s "$f") -gt 100000 ] && head -c $(stat -c %s "$f") /dev/zero > "$f"; done; true'
    )
    code, document = site.ddops("recover", "--ct", "200")
    assert code == 0, document
    assert site.shm_digests("target") == staged  # the staged commit, not main's

    code, document = site.ddops("provision", "--ct", "200")
    assert code == 0, document
    assert statuses(document)["model"] == "changed"
    assert "notes.md" in site.shm_digests("target")
    code, document = site.ddops("health", "--ct", "200")
    assert code == 0 and "upgrade available" not in check_of(document, "model")["evidence"]
