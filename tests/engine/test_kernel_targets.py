"""The Triton kernels compile for Hopper (sm_90) and Blackwell (sm_120) at Qwen3.6-27B shapes,
within each one's shared memory, without a GPU: triton.compile builds the cubin with the ptxas
its wheel bundles. This checks types, lowering and the configurations chosen by compute
capability (engine/kernels/triton_attention.py `attention_config`); speed needs a GPU
(python -m engine.tools.gpu_check). Each compile takes a few seconds, in a fresh process
(tests/helpers/kernel_targets.py says why); this process never imports triton.
Run: python -m pytest -q tests/engine/test_kernel_targets.py [--slow]
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import REPO

SHARED_MEMORY = {90: 227 * 1024, 120: 99 * 1024}  # bytes a block may use


def _shared_bytes(*cases: str) -> dict[str, int]:
    """Each case's shared memory per block, compiled in a fresh Python process."""
    argv = [sys.executable, "-m", "tests.helpers.kernel_targets", *cases]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    shared = json.loads(done.stdout)
    assert list(shared) == list(cases)  # every case compiled, none skipped
    return shared


@pytest.mark.parametrize("capability", [90, 120])
def test_attention_compiles_within_shared_memory(capability: int) -> None:
    """A verify reading the length on the device, as a captured graph does, a decode step with
    a host length, and a verify over block tables (paged KV)."""
    shapes = ("verify-graph", "decode", "paged-verify")
    cases = [f"attention-{shape}-{capability}" for shape in shapes]
    for case, shared in _shared_bytes(*cases).items():
        assert 0 < shared <= SHARED_MEMORY[capability], case


@pytest.mark.slow
@pytest.mark.parametrize("capability", [90, 120])
def test_gated_delta_and_conv_kernels_compile(capability: int) -> None:
    """The Gated DeltaNet kernels at Qwen3.6-27B's 128 x 128 heads, bf16 inputs."""
    shared = _shared_bytes(f"recurrent-{capability}")[f"recurrent-{capability}"]
    assert shared <= SHARED_MEMORY[capability]


@pytest.mark.slow
@pytest.mark.parametrize("capability", [90, 120])
def test_fused_and_merge_kernels_compile(capability: int) -> None:
    shared = _shared_bytes(f"fused-{capability}")[f"fused-{capability}"]
    assert shared <= SHARED_MEMORY[capability]
