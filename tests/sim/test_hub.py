"""The local hub answers the real huggingface_hub client: downloads, typed errors, byte counts."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
from huggingface_hub import snapshot_download
from huggingface_hub.errors import (
    HfHubHTTPError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from ops.sim.hub import LocalHub


@pytest.fixture
def hub_root(tmp_path):
    repo = tmp_path / "hub" / "ddops" / "tiny"
    (repo / "sub").mkdir(parents=True)
    (repo / "config.json").write_text('{"model_type": "qwen3"}')
    (repo / "model.safetensors").write_bytes(os.urandom(50_000))
    (repo / "sub" / "notes.txt").write_text("hello")
    return tmp_path / "hub"


def _tree_digest(path):
    return {
        p.relative_to(path).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


def test_snapshot_download_gets_identical_files_then_serves_nothing_from_cache(hub_root, tmp_path):
    with LocalHub(hub_root) as hub:
        got = snapshot_download("ddops/tiny", endpoint=hub.url, cache_dir=tmp_path / "cache")
        assert _tree_digest(hub_root / "ddops/tiny") == _tree_digest(Path(got))
        assert hub.bytes_served == 50_000 + len('{"model_type": "qwen3"}') + len("hello")
        served = hub.bytes_served
        pinned = hub.repo("ddops/tiny").sha
        snapshot_download(
            "ddops/tiny", revision=pinned, endpoint=hub.url, cache_dir=tmp_path / "cache"
        )
        assert hub.bytes_served == served


def test_resume_with_range_and_typed_errors(hub_root, tmp_path):
    import httpx

    with LocalHub(hub_root) as hub:
        url = f"{hub.url}/ddops/tiny/resolve/main/model.safetensors"
        full = (hub_root / "ddops/tiny/model.safetensors").read_bytes()
        r = httpx.get(url, headers={"Range": "bytes=1000-"})
        assert r.status_code == 206 and r.content == full[1000:]
        with pytest.raises(RepositoryNotFoundError):
            snapshot_download("ddops/missing", endpoint=hub.url, cache_dir=tmp_path / "c")
        with pytest.raises(RevisionNotFoundError):
            snapshot_download(
                "ddops/tiny", revision="v9", endpoint=hub.url, cache_dir=tmp_path / "c"
            )


def test_token_is_required_when_set(hub_root, tmp_path):
    with LocalHub(hub_root, token="hf_secret") as hub:
        with pytest.raises(HfHubHTTPError):
            snapshot_download("ddops/tiny", endpoint=hub.url, cache_dir=tmp_path / "a", token=False)
        snapshot_download(
            "ddops/tiny", endpoint=hub.url, cache_dir=tmp_path / "b", token="hf_secret"
        )
        assert hub.bytes_served > 0


def test_the_byte_count_is_kept_in_the_stats_file_across_restarts(hub_root, tmp_path):
    from ops.sim.hub import served_before

    stats = tmp_path / "hub.json"
    assert served_before(stats) == 0  # no file yet
    with LocalHub(hub_root, stats_file=stats) as hub:
        snapshot_download("ddops/tiny", endpoint=hub.url, cache_dir=tmp_path / "cache")
        served = hub.bytes_served
    assert served > 0
    assert served_before(stats) == served
    with LocalHub(hub_root, stats_file=stats) as again:  # carried on, not started from zero
        assert again.bytes_served == served


def test_a_hub_started_by_this_process_is_reaped_when_it_stops(tmp_path, monkeypatch):
    """The demo starts the host's hub in its own process: stopping it (a reboot does) reaps the
    child at once. Before, stop_hub waited STOP_TIMEOUT_S for the zombie's /proc entry to go,
    5 s of every demo reboot, and left the zombie behind."""
    from ops.sim import hubservice
    from ops.sim.host import destroy_host, init_host

    demo = tmp_path / "demo_model"
    for part in ("target", "draft"):
        (demo / part).mkdir(parents=True)
        (demo / part / "config.json").write_text("{}")
    monkeypatch.setattr(hubservice, "DEMO_MODEL_DIR", demo)
    root = tmp_path / "pve"
    init_host(root, containers="process")
    try:
        hubservice.ensure_hub(root)
        pid = hubservice.running_pid(root)
        assert pid is not None
        assert hubservice.stop_hub(root)
        with pytest.raises(ChildProcessError):  # reaped by stop_hub: no zombie left
            os.waitpid(pid, os.WNOHANG)
        assert not Path(f"/proc/{pid}").exists()
    finally:
        destroy_host(root)
