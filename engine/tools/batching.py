"""Measure a running server's batching: N chat requests at once vs one after another, and a short
request's first token while a long prompt prefills (issue 36's Done-when).

    python -m engine.tools.batching --url http://127.0.0.1:8000 [--methods ar,ddtree:15,auto] \\
        [--concurrency 6] [--max-tokens 96] [--repeats 3] [--long-tokens 3300] [--json]

Throughput: per repeat and method (the methods interleaved within each repeat, so a change of
the machine's load falls on all of them, their order rotated from one repeat to the next, so
none always runs after the same one), the same N greedy chat requests (`cache_prompt` off,
so every prompt is prefilled) one after another, then all at once; aggregate output tok/s =
completion tokens / wall time of each, and their ratio, reported as the median with the min-max
over the repeats. The outputs at once must equal those one after another (exit 1 if not).
Beside each method's ratio: the most rounds a request took at once over their mean. Requests
sent together end together only when their rounds match; past the shorter ones' ends the
longest decodes in ever thinner steps (a tail), so a method whose rounds spread (a tree's
acceptance differs by prompt; `ar` takes one a token) gains less from the batch.
With `auto` beside other methods: auto's tok/s over the best other method's, repeat by repeat,
one after another (concurrency 1) and at once (N), and the mean node count auto chose.
TTFT: a ~`--long-tokens` prompt alone (streamed, 1 token: its time to first token is its prefill,
P), then the same prompt again with a short request sent P/4 after it: the short one's time to
first token, from its own send, against P (Done-when: at most P/5).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time

import httpx

TOPICS = (
    "Write a short story about a robot.",
    "Explain how rain forms.",
    "List five fruits and their colors.",
    "What is the capital of France? Tell me about it.",
    "Describe a sunny day at the beach.",
    "How do plants grow?",
    "Why is the sky blue?",
    "Tell me about the moon.",
)


def chat(text: str, method: str, budget: int | None, max_tokens: int, stream: bool = False) -> dict:
    speculative = {"method": method} | ({"budget": budget} if budget else {})
    return {
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "cache_prompt": False,
        "stream": stream,
        "speculative": speculative,
    }


def parse_method(name: str) -> tuple[str, int | None]:
    method, _, budget = name.partition(":")
    return method, int(budget) if budget else None


async def complete(client: httpx.AsyncClient, body: dict) -> dict:
    response = await client.post("/v1/chat/completions", json=body)
    response.raise_for_status()
    return response.json()


async def throughput(client, bodies: list[dict], at_once: bool) -> tuple[float, list[dict]]:
    """(aggregate output tok/s, the answers) of `bodies`, sent at once or one after another."""
    started = time.perf_counter()
    if at_once:
        answers = await asyncio.gather(*(complete(client, body) for body in bodies))
    else:
        answers = [await complete(client, body) for body in bodies]
    wall = time.perf_counter() - started
    return sum(answer["usage"]["completion_tokens"] for answer in answers) / wall, answers


def texts(answers: list[dict]) -> list[str]:
    return [answer["choices"][0]["message"]["content"] for answer in answers]


def longest_over_mean(answers: list[dict]) -> float:
    """The most rounds an answer took over the answers' mean rounds."""
    rounds = [answer["speculative"]["rounds"] for answer in answers]
    return max(rounds) / max(statistics.fmean(rounds), 1e-9)


def mean_budget(answers: list[dict]) -> float | None:
    """The mean node count auto chose over the answers' rounds (None: not auto)."""
    chosen = [answer.get("speculative", {}).get("budgets") for answer in answers]
    if not all(chosen):
        return None
    rounds = [sum(budgets["histogram"].values()) for budgets in chosen]
    total = sum(budgets["mean"] * count for budgets, count in zip(chosen, rounds, strict=True))
    return total / max(sum(rounds), 1)


async def first_token_s(client: httpx.AsyncClient, body: dict) -> float:
    """Seconds from sending a streamed request to its first content chunk."""
    started = time.perf_counter()
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {") and _has_text(json.loads(line[6:])):
                return time.perf_counter() - started
    raise RuntimeError("the stream ended without a token")


def _has_text(chunk: dict) -> bool:
    """Whether a chat stream's chunk carries generated text (the first one only names the role)."""
    delta = (chunk.get("choices") or [{}])[0].get("delta", {})
    return bool(delta.get("content") or delta.get("reasoning_content"))


async def long_prompt(client: httpx.AsyncClient, tokens: int) -> str:
    """A chat message of about `tokens` tokens (counted by the server's /tokenize)."""
    piece = " ".join(TOPICS) + " "
    count = (await client.post("/tokenize", json={"prompt": piece})).json()["count"]
    return piece * max(1, tokens // count)


async def ttft_under_prefill(client, args: argparse.Namespace) -> dict:
    method, budget = parse_method(args.methods.split(",")[0])
    text = await long_prompt(client, args.long_tokens)
    long_body = chat(text, method, budget, 1, stream=True)
    short_body = chat("Hi!", method, budget, 8, stream=True)
    await first_token_s(client, long_body)  # warm
    prefills, shorts = [], []
    for _ in range(args.repeats):
        prefills.append(await first_token_s(client, long_body))
        running = asyncio.ensure_future(first_token_s(client, long_body))
        await asyncio.sleep(prefills[-1] / 4)
        shorts.append(await first_token_s(client, short_body))
        await running
    prompt_tokens = (await client.post("/tokenize", json={"prompt": text})).json()["count"]
    return {
        "long_prompt_tokens": prompt_tokens,
        "prefill_s": spread(prefills),
        "short_ttft_s": spread(shorts),
        "short_over_prefill": spread([s / p for s, p in zip(shorts, prefills, strict=True)]),
    }


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "low": min(values), "high": max(values)}


async def measure(args: argparse.Namespace) -> dict:
    timeout = httpx.Timeout(args.timeout)
    names = args.methods.split(",")
    bodies = {
        name: [
            chat(TOPICS[i % len(TOPICS)], *parse_method(name), args.max_tokens)
            for i in range(args.concurrency)
        ]
        for name in names
    }
    runs: dict[str, dict[str, list]] = {name: {"serial": [], "at_once": []} for name in names}
    report: dict = {"methods": {}, "equal": True}
    async with httpx.AsyncClient(base_url=args.url, timeout=timeout) as client:
        for name in names:
            await throughput(client, bodies[name][:1], at_once=False)  # warm
        for repeat in range(args.repeats):
            turn = repeat % len(names)  # rotated: no method always runs after the same one
            for name in names[turn:] + names[:turn]:
                one, one_answers = await throughput(client, bodies[name], at_once=False)
                many, many_answers = await throughput(client, bodies[name], at_once=True)
                runs[name]["serial"].append(one)
                runs[name]["at_once"].append(many)
                runs[name].setdefault("budgets", []).append(mean_budget(many_answers))
                runs[name].setdefault("tail", []).append(longest_over_mean(many_answers))
                report["equal"] &= texts(one_answers) == texts(many_answers)
        for name, run in runs.items():
            report["methods"][name] = {
                "one_after_another_tok_s": spread(run["serial"]),
                "at_once_tok_s": spread(run["at_once"]),
                "ratio": spread(
                    [m / o for m, o in zip(run["at_once"], run["serial"], strict=True)]
                ),
                "longest_over_mean_rounds": spread(run["tail"]),
            }
        if "auto" in runs and len(runs) > 1:
            report["auto_over_best"] = auto_over_best(runs)
        report["ttft"] = await ttft_under_prefill(client, args)
    return report


def auto_over_best(runs: dict[str, dict[str, list]]) -> dict:
    """auto's tok/s over the best other method's in the same repeat, one after another and
    at once, and auto's mean chosen node count at once."""
    others = [run for name, run in runs.items() if name != "auto"]
    auto, out = runs["auto"], {}
    for kind in ("serial", "at_once"):
        best = [max(values) for values in zip(*(run[kind] for run in others), strict=True)]
        out[kind] = spread([a / b for a, b in zip(auto[kind], best, strict=True)])
    budgets = [value for value in auto["budgets"] if value is not None]
    out["mean_budget_at_once"] = spread(budgets) if budgets else None
    return out


def lines(report: dict, args: argparse.Namespace) -> list[str]:
    def show(figure: dict, unit: str = "") -> str:
        return f"{figure['median']:.2f}{unit} [{figure['low']:.2f}-{figure['high']:.2f}]"

    out = [f"{args.concurrency} at once vs one after another, {args.repeats} repeats, min-max:"]
    for name, row in report["methods"].items():
        out.append(
            f"  {name:12} one after another {show(row['one_after_another_tok_s'])} tok/s, "
            f"at once {show(row['at_once_tok_s'])} tok/s: {show(row['ratio'], 'x')}; "
            f"longest request's rounds {show(row['longest_over_mean_rounds'], 'x')} the mean"
        )
    ttft = report["ttft"]
    out.append(
        f"  a short request's first token while a {ttft['long_prompt_tokens']}-token prompt "
        f"prefills ({show(ttft['prefill_s'], ' s')}): {show(ttft['short_ttft_s'], ' s')}, "
        f"{show(ttft['short_over_prefill'], 'x')} of the prefill"
    )
    if best := report.get("auto_over_best"):
        chosen = best["mean_budget_at_once"]
        out.append(
            f"  auto over the best other method: one after another {show(best['serial'], 'x')}, "
            f"at once {show(best['at_once'], 'x')}"
            + (f"; mean chosen nodes at once {show(chosen)}" if chosen else "")
        )
    out.append("  outputs at once equal those one after another: " + str(report["equal"]))
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--methods", default="ar,ddtree:15,auto", help="METHOD[:BUDGET],...")
    parser.add_argument("--concurrency", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--long-tokens", type=int, default=3300)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if min(args.concurrency, args.max_tokens, args.repeats, args.long_tokens) < 1:
        parser.error("--concurrency, --max-tokens, --repeats and --long-tokens must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        report = asyncio.run(measure(args))
    except (httpx.HTTPError, RuntimeError) as error:
        print(f"Error: {args.url}: {error}", file=sys.stderr)
        return 1
    print(json.dumps(report) if args.json else "\n".join(lines(report, args)))
    return 0 if report["equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
