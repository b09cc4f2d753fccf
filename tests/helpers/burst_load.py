"""Take the machine's cores in bursts: the disturbance issue 31's bench must survive (a dev tool
for the bench's busy-machine check, not shipped).

    python -m tests.helpers.burst_load --workers 2 --on 1.5 --off 1.5 --seconds 900

Each of `--workers` processes spins a core for `--on` seconds, then sleeps `--off` seconds, with
a random phase and each burst's length drawn between half and one and a half times `--on`, so
the load comes and goes unevenly, as another user's test run or build does. It stops after
`--seconds`, or at Ctrl-C / SIGTERM (the workers with it), and prints how long it was busy.
"""

from __future__ import annotations

import argparse
import multiprocessing
import random
import signal
import sys
import time


def spin_until(deadline: float) -> int:
    count = 0
    while time.monotonic() < deadline:
        count += sum(i * i for i in range(2000)) & 1
    return count


def worker(seed: int, on_s: float, off_s: float, stop_at: float, busy) -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    rng = random.Random(seed)
    time.sleep(rng.uniform(0, on_s + off_s))  # random phase: the workers do not burst in step
    while time.monotonic() < stop_at:
        burst = rng.uniform(0.5 * on_s, 1.5 * on_s)
        spin_until(min(stop_at, time.monotonic() + burst))
        with busy.get_lock():
            busy.value += burst
        time.sleep(min(max(0.0, stop_at - time.monotonic()), rng.uniform(0.5 * off_s, 1.5 * off_s)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2, help="processes, one core each")
    parser.add_argument("--on", type=float, default=1.5, help="mean burst, seconds")
    parser.add_argument("--off", type=float, default=1.5, help="mean pause, seconds")
    parser.add_argument("--seconds", type=float, default=900.0, help="stop after this long")
    parser.add_argument("--seed", type=int, default=31)
    args = parser.parse_args(argv)
    stop_at = time.monotonic() + args.seconds
    busy = multiprocessing.Value("d", 0.0)
    workers = [
        multiprocessing.Process(
            target=worker, args=(args.seed + i, args.on, args.off, stop_at, busy), daemon=True
        )
        for i in range(args.workers)
    ]
    for process in workers:
        process.start()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    started = time.monotonic()
    try:
        for process in workers:
            process.join()
    except (KeyboardInterrupt, SystemExit):
        for process in workers:
            process.terminate()
    elapsed = time.monotonic() - started
    share = busy.value / (elapsed * args.workers) if elapsed else 0.0
    print(f"burst load: {args.workers} workers, busy {share:.0%} of {elapsed:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
