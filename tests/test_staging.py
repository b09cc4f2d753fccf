"""Model staging on this machine (the agent's half): hub -> cache -> shm, verified and repaired."""

from __future__ import annotations

import hashlib
import os
import shutil
from collections import namedtuple
from pathlib import Path

import pytest

from ops.errors import DdopsError
from ops.inventory import ModelRef
from ops.sim.hub import LocalHub
from ops.staging import check_local, stage_local

REF = ModelRef("ddops/tiny", "main", "tiny")


@pytest.fixture
def hub(tmp_path):
    repo = tmp_path / "hub" / "ddops" / "tiny"
    repo.mkdir(parents=True)
    (repo / "config.json").write_text('{"model_type": "qwen3"}')
    (repo / "model.safetensors").write_bytes(os.urandom(200_000))
    with LocalHub(tmp_path / "hub") as hub:
        yield hub


def digests(path: Path) -> dict[str, str]:
    return {
        p.relative_to(path).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in path.rglob("*")
        if p.is_file() and not p.name.startswith(".")
    }


def stage(hub, tmp_path):
    return stage_local(
        REF,
        endpoint=hub.url,
        token=None,
        cache=tmp_path / "cache",
        shm_root=tmp_path / "shm",
        log=lambda m: None,
    )


def test_stage_is_identical_then_unchanged_with_zero_bytes(hub, tmp_path):
    report = stage(hub, tmp_path)
    assert report.changed and sorted(report.copied_files) == ["config.json", "model.safetensors"]
    assert digests(tmp_path / "shm/tiny") == digests(hub.root / "ddops/tiny")
    assert check_local("tiny", tmp_path / "shm", hashes=True) == []
    served, mtime = hub.bytes_served, (tmp_path / "shm/tiny/model.safetensors").stat().st_mtime_ns
    again = stage(hub, tmp_path)
    assert not again.changed and again.copied_files == []
    assert hub.bytes_served == served
    assert (tmp_path / "shm/tiny/model.safetensors").stat().st_mtime_ns == mtime


def test_wiped_shm_is_restaged_from_cache_without_the_hub(hub, tmp_path):
    stage(hub, tmp_path)
    served = hub.bytes_served
    shutil.rmtree(tmp_path / "shm")
    assert check_local("tiny", tmp_path / "shm") == [
        f"{tmp_path}/shm/tiny is not staged (no .ddops-staged.json)"
    ]
    report = stage(hub, tmp_path)
    assert report.changed and report.downloaded_files == []
    assert hub.bytes_served == served
    assert digests(tmp_path / "shm/tiny") == digests(hub.root / "ddops/tiny")


def test_truncated_shm_file_is_detected_and_repaired(hub, tmp_path):
    stage(hub, tmp_path)
    with open(tmp_path / "shm/tiny/model.safetensors", "r+b") as f:
        f.truncate(1000)
    assert check_local("tiny", tmp_path / "shm") == [
        "model.safetensors: 1000 bytes, expected 200000"
    ]
    assert stage(hub, tmp_path).copied_files == ["model.safetensors"]
    assert check_local("tiny", tmp_path / "shm", hashes=True) == []


def test_damaged_cache_is_downloaded_again(hub, tmp_path):
    stage(hub, tmp_path)
    shutil.rmtree(tmp_path / "shm")
    blob = (
        (tmp_path / "cache/models--ddops--tiny/snapshots")
        .rglob("model.safetensors")
        .__next__()
        .resolve()
    )
    blob.write_bytes(b"x" * 200_000)  # same size, wrong bytes
    served = hub.bytes_served
    report = stage(hub, tmp_path)
    assert report.repaired_cache_files == ["model.safetensors"]
    assert hub.bytes_served == served + 200_000
    assert digests(tmp_path / "shm/tiny") == digests(hub.root / "ddops/tiny")


def test_named_failures(hub, tmp_path, monkeypatch):
    with pytest.raises(DdopsError, match="repository not found"):
        stage_local(
            ModelRef("ddops/none"),
            endpoint=hub.url,
            token=None,
            cache=tmp_path / "c",
            shm_root=tmp_path / "s",
        )
    with pytest.raises(DdopsError, match="revision 'v9' not found"):
        stage_local(
            ModelRef("ddops/tiny", "v9"),
            endpoint=hub.url,
            token=None,
            cache=tmp_path / "c",
            shm_root=tmp_path / "s",
        )
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(1 << 20, 1 << 20, 1000))
    with pytest.raises(DdopsError, match="no space left in .*needs 0.00 GiB more, 0.00 GiB free"):
        stage(hub, tmp_path)
