"""Peak resident memory of one `python -m engine ...` command, above what importing costs.

    python -m tests.helpers.peak_rss generate --model DIR --prompt-ids 1,2 --dtype bfloat16

imports torch and the engine's modules, records ru_maxrss (the baseline), runs the engine
command in this same process, and prints one JSON line to stderr:
{"baseline_bytes", "peak_bytes", "extra_bytes", "exit_code"}; the command's own output goes
to stdout as usual. Run it in a fresh subprocess: ru_maxrss never goes down.
"""

from __future__ import annotations

import json
import resource
import sys


def max_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def main(argv: list[str]) -> int:
    import torch  # noqa: F401  (the baseline includes the imports every command makes)

    import engine.cli.generate  # noqa: F401
    import engine.decode  # noqa: F401
    import engine.models.dflash  # noqa: F401
    import engine.models.qwen3  # noqa: F401
    import engine.models.qwen3_5  # noqa: F401
    import engine.parallel  # noqa: F401
    import engine.tokenizer  # noqa: F401
    from engine.__main__ import main as engine_main

    baseline = max_rss_bytes()
    code = engine_main(argv)
    peak = max_rss_bytes()
    report = {
        "baseline_bytes": baseline,
        "peak_bytes": peak,
        "extra_bytes": peak - baseline,
        "exit_code": code,
    }
    print(json.dumps(report), file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
