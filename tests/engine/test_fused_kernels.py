"""The fused layer kernels (engine/kernels/triton_fused.py) match their references, and the
RMSNorm / SwiGLU / Rotary layers use them where the dispatch says "triton".

Kernels run in Triton's CPU interpreter (tests/helpers/kernel_cases.py), at the float32, bf16
and float64 tolerances there. The layers are checked both ways: on CPU tensors they compute
exactly what they always did (the transformers-matching plain torch), and with the dispatch
forced to Triton (as on CUDA) they launch the fused kernels, agree with the plain path, stay
differentiable when gradients are wanted, and compile with fullgraph=True (no hidden sync).
Run: python -m pytest -q tests/engine/test_fused_kernels.py
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from engine import kernels
from engine.kernels import reference
from engine.models.common import RMSNorm, Rotary, SwiGLU
from tests.helpers.kernel_cases import TOLERANCE, import_interpreted, interpreter_for

MODULES = ("engine.kernels.triton_fused",)
triton_fused = import_interpreted(MODULES[0])

DTYPES = [torch.float32, torch.bfloat16, torch.float64]


@pytest.fixture(scope="module", autouse=True)
def _interpreter_for_this_module() -> Iterator[None]:
    yield from interpreter_for(MODULES)


def _randn(*shape: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)


def _assert_matches(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.dtype == expected.dtype
    assert actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, **TOLERANCE[dtype])


def _tables(positions: torch.Tensor, rotary_dim: int, dtype: torch.dtype):
    return Rotary(rotary_dim, 1e4).tables(positions, dtype)


# --- kernels against the references -----------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("zero_centered", [False, True], ids=["qwen3", "qwen3_5"])
def test_rms_norm_matches_reference(dtype: torch.dtype, zero_centered: bool) -> None:
    x = _randn(3, 5, 40, dtype=dtype)  # 40: a masked row block
    weight = _randn(40, dtype=dtype, seed=1)
    expected = reference.rms_norm(x, weight, 1e-6, zero_centered)
    _assert_matches(triton_fused.rms_norm(x, weight, 1e-6, zero_centered), expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("zero_centered", [False, True], ids=["qwen3", "qwen3_5"])
def test_add_rms_norm_returns_the_norm_and_the_sum(dtype: torch.dtype, zero_centered) -> None:
    x, delta = _randn(4, 64, dtype=dtype), _randn(4, 64, dtype=dtype, seed=2)
    weight = _randn(64, dtype=dtype, seed=1)

    normed, summed = triton_fused.add_rms_norm(x, delta, weight, 1e-6, zero_centered)

    expected_normed, expected_sum = reference.add_rms_norm(x, delta, weight, 1e-6, zero_centered)
    _assert_matches(summed, expected_sum, dtype)
    _assert_matches(normed, expected_normed, dtype)


def test_rms_norm_reads_strided_heads_in_place() -> None:
    """Per-head norms of queries sliced from a wider projection ([T, H, 2D] -> [T, H, D])."""
    q = _randn(3, 4, 2 * 16, dtype=torch.float32)[..., :16]
    weight = _randn(16, dtype=torch.float32, seed=1)
    out = triton_fused.rms_norm(q, weight, 1e-6, True)
    _assert_matches(out, reference.rms_norm(q, weight, 1e-6, True), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("H", "D", "rotary_dim"),
    [(4, 32, 32), (6, 64, 16), (20, 16, 8)],
    ids=["full", "partial_quarter", "two_head_blocks"],
)
def test_rotary_matches_reference(dtype: torch.dtype, H: int, D: int, rotary_dim: int) -> None:
    x = _randn(5, H, D, dtype=dtype)
    cos, sin = _tables(torch.tensor([7, 8, 8, 9, 12]), rotary_dim, dtype)  # tree depths
    _assert_matches(
        triton_fused.apply_rotary(x, cos, sin), reference.apply_rotary(x, cos, sin), dtype
    )


def test_rotary_on_strided_queries_and_leading_dims() -> None:
    """Queries sliced from a [T, H, 2D] projection (Qwen3.5's q and gate), and a batch of
    blocks [B, T, H, D] sharing [T, R] tables."""
    q = _randn(4, 3, 2 * 16, dtype=torch.float32)[..., :16]
    cos, sin = _tables(torch.arange(4), 8, torch.float32)
    _assert_matches(
        triton_fused.apply_rotary(q, cos, sin), reference.apply_rotary(q, cos, sin), torch.float32
    )
    blocks = _randn(2, 4, 3, 16, dtype=torch.float32)
    _assert_matches(
        triton_fused.apply_rotary(blocks, cos, sin),
        reference.apply_rotary(blocks, cos, sin),
        torch.float32,
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_reference(dtype: torch.dtype) -> None:
    gate, up = _randn(3, 1500, dtype=dtype), _randn(3, 1500, dtype=dtype, seed=1)  # 2 blocks
    _assert_matches(triton_fused.silu_mul(gate, up), reference.silu_mul(gate, up), dtype)


def test_fused_kernels_refuse_mismatched_inputs() -> None:
    x = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="delta"):
        triton_fused.add_rms_norm(x, torch.zeros(2, 4), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="up"):
        triton_fused.silu_mul(x, x.double())
    with pytest.raises(ValueError, match="rotary tables of width 9"):
        triton_fused.apply_rotary(torch.zeros(2, 1, 8), torch.zeros(2, 9), torch.zeros(2, 9))


def test_empty_inputs_give_empty_outputs() -> None:
    empty = torch.zeros(0, 8)
    assert triton_fused.rms_norm(empty, torch.ones(8), 1e-6).shape == (0, 8)
    assert triton_fused.silu_mul(empty, empty).shape == (0, 8)
    cos, sin = torch.zeros(0, 8), torch.zeros(0, 8)
    assert triton_fused.apply_rotary(torch.zeros(0, 2, 8), cos, sin).shape == (0, 2, 8)


# --- the layers ----------------------------------------------------------------------------


class _Layers(torch.nn.Module):
    """A pre-norm block's pieces: norm, RoPE'd heads, residual add + norm, SwiGLU."""

    def __init__(self, hidden: int = 32, heads: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.heads = heads
        self.norm = RMSNorm(hidden, 1e-6)
        self.post_norm = RMSNorm(hidden, 1e-6)
        self.rotary = Rotary(hidden // heads, 1e4, partial_rotary_factor=0.5)
        self.mlp = SwiGLU(hidden, 48)
        with torch.no_grad():
            for norm in (self.norm, self.post_norm):
                norm.weight.normal_()

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # [T, H]
        h = self.norm(x)
        cos, sin = self.rotary.tables(positions, x.dtype)
        h = self.rotary.apply(h.unflatten(-1, (self.heads, -1)), cos, sin).flatten(-2)
        normed, summed = self.post_norm.add_then_norm(x, h)
        return summed + self.mlp(normed)


def _plain(layers: _Layers, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The same block written out in plain torch, as the layers computed it before fusion."""
    w1, w2 = layers.norm.weight, layers.post_norm.weight

    def norm(t, w):
        tf = t.float()
        return w * (tf * torch.rsqrt(tf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(t.dtype)

    cos, sin = layers.rotary.tables(positions, x.dtype)
    heads = norm(x, w1).unflatten(-1, (layers.heads, -1))
    R = cos.shape[-1]
    rot, rest = heads[..., :R], heads[..., R:]
    half = torch.cat([-rot[..., R // 2 :], rot[..., : R // 2]], dim=-1)
    c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)
    h = torch.cat([rot * c + half * s, rest], dim=-1).flatten(-2)
    summed = x + h
    mlp = layers.mlp
    normed = norm(summed, w2)
    return summed + mlp.down_proj(F.silu(mlp.gate_proj(normed)) * mlp.up_proj(normed))


@pytest.fixture
def fused_launches(monkeypatch: pytest.MonkeyPatch) -> Counter:
    """The dispatch as on CUDA (backend "triton"), counting calls of each fused kernel."""
    monkeypatch.setattr(kernels, "_fused_backend", lambda tensor: "triton")
    calls: Counter = Counter()
    for name in ("rms_norm", "add_rms_norm", "apply_rotary", "silu_mul"):
        kernel = getattr(triton_fused, name)

        def counted(*args, _kernel=kernel, _name=name, **kwargs):
            calls[_name] += 1
            return _kernel(*args, **kwargs)

        monkeypatch.setattr(triton_fused, name, counted)
    return calls


X, POSITIONS = _randn(5, 32, dtype=torch.float32, seed=3), torch.tensor([3, 4, 4, 5, 6])


def test_layers_on_cpu_compute_what_they_always_did() -> None:
    layers = _Layers()
    with torch.no_grad():
        assert torch.equal(layers(X, POSITIONS), _plain(layers, X, POSITIONS))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layers_launch_the_fused_kernels_where_triton_is_chosen(
    fused_launches: Counter, dtype: torch.dtype
) -> None:
    layers = _Layers().to(dtype)
    x = X.to(dtype)
    with torch.no_grad():
        out = layers(x, POSITIONS)
    assert fused_launches == {"rms_norm": 1, "add_rms_norm": 1, "apply_rotary": 1, "silu_mul": 1}
    with torch.no_grad():
        _assert_matches(out, _plain(layers, x, POSITIONS), dtype)


def test_layers_keep_autograd_when_gradients_are_wanted(fused_launches: Counter) -> None:
    """Training (the drafter's) differentiates through the plain path: no fused kernel runs."""
    layers = _Layers()
    layers(X, POSITIONS).sum().backward()
    assert not fused_launches
    assert layers.norm.weight.grad is not None


def test_layers_compile_without_graph_breaks_on_cpu() -> None:
    """fullgraph=True raises on a graph break: a hidden host sync or data-dependent Python."""
    layers = _Layers()
    compiled = torch.compile(layers, fullgraph=True, backend="eager")
    with torch.no_grad():
        assert torch.equal(compiled(X, POSITIONS), layers(X, POSITIONS))


def test_fused_backend_follows_the_kernels_choice_on_cuda_only(monkeypatch) -> None:
    on_cuda, on_cpu = SimpleNamespace(is_cuda=True), SimpleNamespace(is_cuda=False)
    monkeypatch.setattr(kernels, "_triton_importable", lambda: True)
    monkeypatch.delenv(kernels.BACKEND_ENV, raising=False)
    assert kernels._fused_backend(on_cuda) == "triton"
    assert kernels._fused_backend(on_cpu) == "reference"
    monkeypatch.setenv(kernels.BACKEND_ENV, "reference")
    assert kernels._fused_backend(on_cuda) == "reference"
