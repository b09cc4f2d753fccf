"""Triton kernels, each with a plain-torch reference that is its specification."""
