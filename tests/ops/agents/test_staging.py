"""Model staging on this machine (the agent's half): hub -> cache -> shm, verified and repaired."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import pytest

from ops.agents.staging import agent_main, check_local, stage_local, staged_commit
from ops.errors import DdopsError
from ops.sim.hub import LocalHub
from ops.site.inventory import ModelRef

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


def stage(hub, tmp_path, refresh: bool = False):
    return stage_local(
        REF,
        endpoint=hub.url,
        token=None,
        cache=tmp_path / "cache",
        shm_root=tmp_path / "shm",
        log=lambda m: None,
        refresh=refresh,
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


# -- verify before staging; the stamp; hub failures ------------------------------------------------
def closed_url() -> str:
    """A hub address nothing listens on (a stopped LocalHub may still answer on a kept-alive
    connection of the client's pool)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def cache_blob(tmp_path: Path) -> Path:
    snapshots = tmp_path / "cache/models--ddops--tiny/snapshots"
    return next(snapshots.rglob("model.safetensors")).resolve()


def test_a_damaged_cache_with_the_hub_down_stages_nothing_and_names_the_file(hub, tmp_path):
    """The finding: the damaged cache file was moved into /dev/shm before its hash was checked,
    the re-download failed with a raw ValueError, and the old stamp still said "staged"."""
    stage(hub, tmp_path)
    shm_file = tmp_path / "shm/tiny/model.safetensors"
    shm_file.write_bytes(b"y" * 200_000)  # changed in /dev/shm (same size) ...
    cache_blob(tmp_path).write_bytes(b"x" * 200_000)  # ... and the cache is damaged too
    with pytest.raises(DdopsError) as caught:
        stage_local(
            REF,
            endpoint=closed_url(),
            token=None,
            cache=tmp_path / "cache",
            shm_root=tmp_path / "shm",
            log=lambda m: None,
        )
    message = str(caught.value)
    assert message.startswith(
        "model ddops/tiny: model.safetensors: the cached copy does not match its sha256 and "
        "fetching it again failed: "
    )
    assert "\n" not in message
    assert shm_file.read_bytes() == b"y" * 200_000  # the damaged cache never reached /dev/shm
    assert check_local("tiny", tmp_path / "shm") == [
        f"{tmp_path}/shm/tiny is not staged (no .ddops-staged.json)"
    ]


def test_a_first_download_with_the_hub_down_is_one_error(tmp_path):
    with LocalHub(tmp_path / "empty") as down:
        url = down.url
    with pytest.raises(
        DdopsError, match=r"^model ddops/tiny: hub unreachable and not in the cache"
    ):
        stage_local(REF, endpoint=url, token=None, cache=tmp_path / "c", shm_root=tmp_path / "s")


def test_the_stamp_records_each_files_size_sha256_and_mtime(hub, tmp_path):
    stage(hub, tmp_path)
    stamp = json.loads((tmp_path / "shm/tiny/.ddops-staged.json").read_text())
    hub_files = digests(hub.root / "ddops/tiny")
    for entry in stamp["files"]:
        staged = tmp_path / "shm/tiny" / entry["path"]
        assert entry["sha256"] == hub_files[entry["path"]]
        assert (entry["size"], entry["mtime_ns"]) == (
            staged.stat().st_size,
            staged.stat().st_mtime_ns,
        )


def test_a_same_size_change_is_found_by_mtime_and_by_hashes(hub, tmp_path):
    """Sizes only said "complete" for a file changed in place."""
    stage(hub, tmp_path)
    shm_file = tmp_path / "shm/tiny/model.safetensors"
    before = shm_file.stat()
    shm_file.write_bytes(b"z" * 200_000)
    assert check_local("tiny", tmp_path / "shm") == [
        "model.safetensors: changed since it was staged (mtime)"
    ]
    os.utime(shm_file, ns=(before.st_atime_ns, before.st_mtime_ns))  # mtime put back: only
    assert check_local("tiny", tmp_path / "shm") == []  # the full hash check can tell
    assert check_local("tiny", tmp_path / "shm", hashes=True) == [
        "model.safetensors: content differs (sha256)"
    ]
    assert stage(hub, tmp_path).copied_files == []  # staging trusts the cheap check too ...
    shm_file.touch()
    assert stage(hub, tmp_path).copied_files == ["model.safetensors"]  # ... until it differs
    assert check_local("tiny", tmp_path / "shm", hashes=True) == []


def test_the_agent_reports_a_hub_failure_as_one_json_error(tmp_path):
    argv = ["stage", "--model", "tiny", "ddops/tiny", "main", "--endpoint", closed_url()]
    argv += ["--cache", str(tmp_path / "c"), "--shm", str(tmp_path / "s")]
    proc = subprocess.run(
        [sys.executable, "-m", "ops.agents.staging", *argv],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    (line,) = proc.stdout.splitlines()
    assert json.loads(line)["error"].startswith("model ddops/tiny: hub unreachable")


def test_one_run_of_the_agent_stages_and_checks_every_model(hub, tmp_path, capsys):
    """The chain's model check runs the agent once per CT, not once per model: every model
    named is staged (or checked) in that run, reported in order."""
    shutil.copytree(hub.root / "ddops/tiny", hub.root / "ddops/other")
    where = ["--cache", str(tmp_path / "cache"), "--shm", str(tmp_path / "shm")]
    check = ["check", "--name", "tiny", "--name", "other", *where]
    assert agent_main(check) == 0
    before = json.loads(capsys.readouterr().out)["models"]
    assert [(m["name"], m["complete"]) for m in before] == [("tiny", False), ("other", False)]
    models = ["--model", "tiny", "ddops/tiny", "main", "--model", "other", "ddops/other", "main"]
    assert agent_main(["stage", *models, "--endpoint", hub.url, *where]) == 0
    staged = json.loads(capsys.readouterr().out)["models"]
    assert [(m["name"], sorted(m["copied_files"])) for m in staged] == [
        ("tiny", ["config.json", "model.safetensors"]),
        ("other", ["config.json", "model.safetensors"]),
    ]
    assert digests(tmp_path / "shm/other") == digests(hub.root / "ddops/other")
    assert agent_main([*check, "--hashes"]) == 0
    after = json.loads(capsys.readouterr().out)["models"]
    assert [(m["name"], m["problems"], m["commit"]) for m in after] == [
        (m["name"], [], m["commit"]) for m in staged
    ]


def test_the_hub_going_down_between_download_and_its_file_list_is_one_error(
    hub, tmp_path, monkeypatch
):
    from huggingface_hub import HfApi

    def unreachable(self, *args, **kwargs):
        raise ConnectionRefusedError(111, "Connection refused")

    monkeypatch.setattr(HfApi, "list_repo_tree", unreachable)
    with pytest.raises(
        DdopsError, match=r"^model ddops/tiny: hub error \(ConnectionRefusedError\)"
    ):
        stage(hub, tmp_path)


# -- exact revisions: the commit a branch resolved to is the one staged, repaired, reported --------


def move_main(hub) -> dict[str, str]:
    """Push a new commit to the hub's main (new weights); the old commit's digests."""
    before = digests(hub.root / "ddops/tiny")
    (hub.root / "ddops/tiny/model.safetensors").write_bytes(os.urandom(200_000))
    return before


def damage_cached_weights(tmp_path) -> None:
    snapshots = tmp_path / "cache/models--ddops--tiny/snapshots"
    next(snapshots.rglob("model.safetensors")).resolve().write_bytes(b"x" * 200_000)


def test_a_repair_fetches_the_staged_commit_after_main_moved(hub, tmp_path):
    """The finding: the repair fetched `main` (other bytes by then) and failed its sha256."""
    first = stage(hub, tmp_path)
    staged = digests(tmp_path / "shm/tiny")
    assert move_main(hub) == staged
    shutil.rmtree(tmp_path / "shm")
    damage_cached_weights(tmp_path)
    report = stage(hub, tmp_path)
    assert report.repaired_cache_files == ["model.safetensors"]
    assert report.commit == first.commit  # not main's new commit
    assert digests(tmp_path / "shm/tiny") == staged
    assert staged_commit("tiny", tmp_path / "shm") == first.commit


def test_a_lost_cache_snapshot_is_fetched_at_the_staged_commit(hub, tmp_path):
    first = stage(hub, tmp_path)
    staged = digests(tmp_path / "shm/tiny")
    move_main(hub)
    shutil.rmtree(tmp_path / "shm")
    shutil.rmtree(tmp_path / "cache/models--ddops--tiny/snapshots")
    report = stage(hub, tmp_path)
    assert report.commit == first.commit and digests(tmp_path / "shm/tiny") == staged


def test_refresh_moves_to_the_branchs_new_commit(hub, tmp_path):
    first = stage(hub, tmp_path)
    move_main(hub)
    assert stage(hub, tmp_path).commit == first.commit  # without refresh: what was staged
    report = stage(hub, tmp_path, refresh=True)
    assert report.commit != first.commit and report.downloaded_files
    assert digests(tmp_path / "shm/tiny") == digests(hub.root / "ddops/tiny")
    assert staged_commit("tiny", tmp_path / "shm") == report.commit
