"""`--no-cuda-graphs` on generate, bench and serve turns GenerationConfig.cuda_graphs off.

Run: python -m pytest -q tests/engine/test_cuda_graph_flags.py
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import pytest

from engine.cli import bench, generate, serve
from engine.decode import GenerationConfig

REQUIRED = {
    generate: ["--model", "m", "--prompt-ids", "1,2"],
    bench: ["--model", "m", "--draft", "d"],
    serve: ["--model", "m"],
}


@pytest.mark.parametrize("command", [generate, bench, serve], ids=lambda c: c.__name__)
def test_graphs_are_on_unless_switched_off(command):
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    assert parser.parse_args(REQUIRED[command]).cuda_graphs is True
    assert parser.parse_args([*REQUIRED[command], "--no-cuda-graphs"]).cuda_graphs is False


def test_serve_gives_every_generation_its_options():
    @dataclass
    class Engine:
        generate: object

    seen = []
    engine = Engine(generate=lambda ids, cfg, **_: seen.append(cfg))
    configured = serve.with_generation_options(engine, prefill_chunk=64, cuda_graphs=False)
    configured.generate([1], GenerationConfig(method="ar"))
    assert (seen[0].prefill_chunk, seen[0].cuda_graphs, seen[0].method) == (64, False, "ar")
