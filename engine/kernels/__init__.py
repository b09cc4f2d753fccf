"""Tree kernels: Triton on CUDA, the plain-torch references (the specification) elsewhere.

Import the dispatching names from here: `from engine.kernels import tree_attention`.
"""

from engine.kernels.reference import tree_attention, tree_causal_conv1d, tree_gated_delta_rule

__all__ = ["tree_attention", "tree_causal_conv1d", "tree_gated_delta_rule"]
