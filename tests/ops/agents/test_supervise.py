"""The supervisor's reading of a unit's User= and Group= (the rest runs in tests/integration/test_deploy.py)."""

from __future__ import annotations

import os

import pytest

from ops.agents.supervise import Supervisor, UnitCommand

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="User= applies only as root")


def supervisor(**privileges) -> Supervisor:
    return Supervisor(UnitCommand(["/bin/true"], **privileges), {}, "/dev/null", "/dev/null")


@needs_root
def test_user_and_group_resolve_to_ids():
    assert supervisor(user="root", group="0").credentials() == (0, 0)
    assert supervisor(user="root").credentials() == (0, 0)  # the user's own group


@needs_root
def test_an_unknown_user_or_group_is_refused_in_words():
    with pytest.raises(ValueError, match="User=no-such-ddops-user: no such user"):
        supervisor(user="no-such-ddops-user").credentials()
    with pytest.raises(ValueError, match="Group=no-such-ddops-group: no such group"):
        supervisor(user="root", group="no-such-ddops-group").credentials()
