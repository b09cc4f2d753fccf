"""The engine's tools: the demo trainer, the load test, measurement scripts and the GPU check.

Nothing in the runtime (models, kernels, decode, server) imports them.
"""
