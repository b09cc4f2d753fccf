"""Shared test set-up: isolated homes, markers, and prerequisites.

Every test runs with DDOPS_HOME, HF_HOME, HOME and XDG dirs in its own tmp dir, so no test
reads or writes the user's config, caches or ~/.ssh. Markers (see pyproject.toml):
slow (run with --slow), ssh, ansible, lxc, gpu. A test whose prerequisite is missing is
skipped, except under CI=true, where it fails: CI installs every prerequisite.
"""

from __future__ import annotations

import importlib.util
import os
import shutil

import pytest

from tests.helpers.sshd import running_sshd


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--slow", action="store_true", help="also run tests marked slow")


def _cuda_available() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return torch.cuda.is_available()


def _missing_prerequisite(marker: str) -> str | None:
    if marker == "lxc" and (os.geteuid() != 0 or not shutil.which("lxc-start")):
        return "needs root and Debian's lxc (apt-get install lxc busybox-static)"
    if marker == "ssh" and not os.path.exists("/usr/sbin/sshd"):
        return "needs openssh-server (/usr/sbin/sshd)"
    if marker == "ansible" and not shutil.which("ansible-playbook"):
        return "needs ansible-playbook on PATH"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    run_slow = config.getoption("--slow")
    in_ci = os.environ.get("CI") == "true"
    cuda = None
    for item in items:
        if "slow" in item.keywords and not run_slow:
            item.add_marker(pytest.mark.skip(reason="slow: run with --slow"))
        if "gpu" in item.keywords:
            cuda = _cuda_available() if cuda is None else cuda
            if not cuda:
                item.add_marker(pytest.mark.skip(reason="needs CUDA"))
        for marker in ("lxc", "ssh", "ansible"):
            if marker in item.keywords and not in_ci and (why := _missing_prerequisite(marker)):
                item.add_marker(pytest.mark.skip(reason=why))


@pytest.fixture(autouse=True)
def _prerequisites_present_in_ci(request: pytest.FixtureRequest) -> None:
    """Under CI a missing prerequisite is a failure, not a skip: CI installs them all."""
    for marker in ("lxc", "ssh", "ansible"):
        if request.node.get_closest_marker(marker) and (why := _missing_prerequisite(marker)):
            pytest.fail(f"CI lacks a prerequisite: {why}")


@pytest.fixture(autouse=True)
def isolated_homes(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch):
    """Point every config and cache location at a fresh tmp dir."""
    home = tmp_path_factory.mktemp("home")
    for var, sub in {
        "HOME": "",
        "DDOPS_HOME": "ddops",
        "HF_HOME": "hf",
        "XDG_CONFIG_HOME": "config",
        "XDG_CACHE_HOME": "cache",
    }.items():
        path = home / sub
        path.mkdir(parents=True, exist_ok=True)
        monkeypatch.setenv(var, str(path))
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "DDOPS_INVENTORY", "DDOPS_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    return home


@pytest.fixture(scope="module")
def sshd_server(tmp_path_factory: pytest.TempPathFactory):
    """A real sshd on loopback for the module's tests (tests/helpers/sshd.py; marker `ssh`)."""
    with running_sshd(tmp_path_factory.mktemp("sshd")) as server:
        yield server
