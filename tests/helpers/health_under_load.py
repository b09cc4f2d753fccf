"""How long `/health` takes while a running engine server tokenises one large prompt.

    python -m tests.helpers.health_under_load --url http://127.0.0.1:8000 --prompt-bytes 1000000

sends `POST /tokenize` with a prompt of that many bytes of random words (seeded), and meanwhile
polls `GET /health` one request at a time; prints one JSON line: {"prompt_bytes",
"tokens", "tokenize_s", "health_polls", "health_max_s", "health_median_s"} over the polls that
started before /tokenize answered. Works against any server (any revision of it).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time

import httpx


def random_words(size: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    words = [
        "".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(2, 9))) for _ in range(5000)
    ]
    text = []
    length = 0
    while length < size:
        word = rng.choice(words)
        text.append(word)
        length += len(word) + 1
    return " ".join(text)[:size]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--prompt-bytes", type=int, default=1_000_000)
    parser.add_argument("--api-key")
    args = parser.parse_args(argv)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    prompt = random_words(args.prompt_bytes)
    answer: dict = {}

    def tokenize() -> None:
        started = time.perf_counter()
        response = httpx.post(
            args.url + "/tokenize", json={"prompt": prompt}, headers=headers, timeout=600
        )
        answer["tokens"] = response.json().get("count")
        answer["seconds"] = time.perf_counter() - started

    worker = threading.Thread(target=tokenize)
    worker.start()
    latencies = []
    with httpx.Client(base_url=args.url, timeout=600) as http:
        while worker.is_alive():
            started = time.perf_counter()
            http.get("/health").raise_for_status()
            latencies.append(time.perf_counter() - started)
    worker.join()
    report = {
        "prompt_bytes": args.prompt_bytes,
        "tokens": answer.get("tokens"),
        "tokenize_s": round(answer["seconds"], 3),
        "health_polls": len(latencies),
        "health_max_s": round(max(latencies), 3),
        "health_median_s": round(statistics.median(latencies), 4),
    }
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
