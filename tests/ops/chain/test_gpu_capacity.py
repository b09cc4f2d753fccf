"""The engine's memory plan (engine/memory_plan.py) held against the host's GPUs before anything is
created: `ddops provision`'s gpu-capacity check, on a simulated host whose fake GPUs carry a
memory size (`ddops sim init --gpu-memory-mib`), with Qwen3.6-27B's published config.json files
(tests/data/qwen36_27b) served by a local hub (no weights: the plan needs the shapes only).

    python -m pytest -q tests/ops/chain/test_gpu_capacity.py
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from ops.chain import setup as host_setup
from ops.host.transport import LocalTransport
from ops.sim.host import destroy_host, init_host
from ops.sim.hub import LocalHub
from ops.site.inventory import ContainerSpec, EngineSpec, ModelRef, ModelSpec
from tests.helpers import DATA
from tests.helpers.site import sim_site

QWEN = DATA / "qwen36_27b"
TARGET, DRAFT = "Qwen/Qwen3.6-27B", "z-lab/Qwen3.6-27B-DFlash"


@pytest.fixture(scope="module")
def qwen_hub_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("qwen-hub")
    for part, repo in (("target", TARGET), ("draft", DRAFT)):
        (root / repo).mkdir(parents=True)
        shutil.copy(QWEN / part / "config.json", root / repo / "config.json")
    return root


def qwen_model(hub_url: str) -> ModelSpec:
    return ModelSpec(ModelRef(TARGET, "main", "target"), ModelRef(DRAFT, "main", "draft"), hub_url)


def fit_on(tmp_path: Path, hub_root: Path, gpu_mib: int, max_model_len: int, tp=1, **engine):
    root = tmp_path / f"pve-{gpu_mib}-{tp}-{'-'.join(map(str, engine.values()))}"
    init_host(root, gpus=tp, containers="process", gpu_memory_mib=gpu_mib)
    try:
        with LocalHub(hub_root) as hub:
            t = LocalTransport(sysroot=str(root))
            spec = EngineSpec(dtype="bfloat16", max_model_len=max_model_len, tp=tp, **engine)
            ct = ContainerSpec(200, gpus=tuple(range(tp)))
            return host_setup.gpu_capacity(t, ct, qwen_model(hub.url), spec, None)
    finally:
        destroy_host(root)


def test_qwen_27b_with_32k_fits_a_96_gb_card(tmp_path, qwen_hub_root):
    fit = fit_on(tmp_path, qwen_hub_root, 97887, 32768)
    assert fit.problem is None
    assert fit.evidence.startswith("CT 200: GPU 0 (95.6 GiB, bfloat16, tp 1): weights ")
    weights = float(fit.evidence.split("weights ")[1].split(" GiB")[0])
    assert 50 < weights < 56  # ~26.9B + ~1.7B parameters at 2 bytes (FACTS.md)


def test_the_evidence_says_how_many_sequences_of_the_context_fit(tmp_path, qwen_hub_root):
    fit = fit_on(tmp_path, qwen_hub_root, 97887, 32768, max_num_seqs=8)
    assert fit.problem is None
    assert fit.evidence.endswith("; 9 sequences of 32768 tokens fit at once")


def test_more_sequences_than_the_card_holds_fail_with_how_many_do(tmp_path, qwen_hub_root):
    fit = fit_on(tmp_path, qwen_hub_root, 97887, 32768, max_num_seqs=12)
    assert fit.problem.startswith(
        "CT 200: GPU 0 (95.6 GiB, bfloat16, tp 1): 12 sequences of 32768 tokens need "
    )
    assert fit.problem.endswith(": set max_num_seqs to at most 9")
    # one sequence of the same length fits: the sequences are what fail
    assert fit_on(tmp_path, qwen_hub_root, 97887, 32768, max_num_seqs=1).problem is None


def test_a_shared_kv_pool_holds_more_sequences_than_whole_contexts(tmp_path, qwen_hub_root):
    pooled = fit_on(tmp_path, qwen_hub_root, 97887, 32768, max_num_seqs=16, kv_cache_tokens=262_144)
    assert pooled.problem is None  # 16 whole 32k contexts would need 107 GiB
    assert pooled.evidence.endswith("; 7 sequences of 32768 tokens fit at once")
    large = fit_on(tmp_path, qwen_hub_root, 97887, 32768, max_num_seqs=16, kv_cache_tokens=400_000)
    assert "kv_cache_tokens 400000 needs " in large.problem


def test_tensor_parallel_counts_one_sequence_as_its_engine_runs(tmp_path, qwen_hub_root):
    fit = fit_on(tmp_path, qwen_hub_root, 97887, 32768, max_num_seqs=64, tp=2)
    assert fit.problem is None


def test_a_context_that_cannot_fit_is_refused_with_the_numbers(tmp_path, qwen_hub_root):
    fit = fit_on(tmp_path, qwen_hub_root, 97887, 1_000_000)
    assert fit.problem.startswith(
        "CT 200: GPU 0 (95.6 GiB, bfloat16, tp 1): max_model_len 1000000 needs "
    )
    assert "the longest context that fits is " in fit.problem


@pytest.mark.lxc
def test_qwen_27b_onto_a_48_gb_gpu_fails_provision_before_anything_is_created(
    tmp_path, qwen_hub_root
):
    with sim_site(tmp_path, qwen_hub_root, gpu_memory_mib=49140) as site:
        document = yaml.safe_load(site.inventory.read_text())
        model = document["all"]["vars"]["ddops_model"]
        model["target"]["repo"], model["draft"]["repo"] = TARGET, DRAFT
        document["all"]["vars"]["ddops_engine"].update(dtype="bfloat16", max_model_len=32768)
        site.inventory.write_text(yaml.safe_dump(document))
        code, result = site.ddops("provision", "--ct", "200")
        assert code == 1
        checks = {c["key"]: c for c in result["cts"][0]["checks"]}
        gpu = checks["gpu-capacity"]
        assert gpu["status"] == "failed"
        assert gpu["evidence"].startswith(
            f"CT 200: GPU 0 (48.0 GiB, bfloat16, tp 1): {TARGET} does not fit: weights "
        )
        assert checks["boot"]["status"] == checks["ct-exists"]["status"] == "skipped"
        assert not (site.root / "etc/pve/lxc/200.conf").exists()
        assert not (site.root / "etc/systemd/system/ddops-recover.service").exists()
