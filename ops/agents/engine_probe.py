#!/usr/bin/env python3
"""The engine's health probe: run inside a container by the engine's Python. Stdlib only.

    pct exec 200 -- /opt/ddops/venv/bin/python -I -S - 8000 /etc/ddops/engine.env 30 DDOPS_API_KEY \
        [--wait 6] < ops/agents/engine_probe.py

1. GET /ready must answer 200; with `--wait S`, an engine still starting (nothing listening yet,
   or /ready answering 503) is asked again for up to S seconds, the pause growing from 0.05 s to
   0.1 s (so it answers at most 0.1 s after the engine is ready; an ask costs a refused connect
   or a 503): one `pct exec` waits in the CT instead of one per poll (ops/chain/deploy.py's
   wait_ready);
2. a 4-token greedy completion must come back with text and usage;
3. /v1/models without the key says whether the engine requires one: when a key is installed in
   the env file (its line `KEY_VAR=...` becomes the Bearer token), the engine must refuse a
   request without it (401).

Prints one line: the problem (exit 1), or the answer as JSON (exit 0) with "text", "usage",
"key_installed" and "key_required". ops/chain/deploy.py's engine_health runs it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request

JSON_HEADERS = {"Content-Type": "application/json"}
FIRST_PAUSE_S, LAST_PAUSE_S = 0.05, 0.1  # between /ready asks while the engine starts


class Unhealthy(Exception):
    """What is wrong with the engine, in one line."""


def bearer_headers(env_file: str, key_var: str) -> dict[str, str]:
    """JSON headers, with the Bearer token of the env file's `key_var=` line when it has one."""
    headers = dict(JSON_HEADERS)
    try:
        with open(env_file) as lines:
            for line in lines:
                if line.startswith(key_var + "="):
                    headers["Authorization"] = "Bearer " + line.split("=", 1)[1].strip()
    except FileNotFoundError:
        pass
    return headers


def call(url: str, headers: dict, timeout: float, body: dict | None = None) -> tuple[int, dict]:
    """(status, JSON answer) of a GET, or a POST of `body`; an error's body when it is JSON."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            return answer.status, json.load(answer)
    except urllib.error.HTTPError as error:
        try:
            return error.code, json.load(error)
        except ValueError:
            return error.code, {}


def _reason(answer: dict, *keys: str) -> str:
    return ": ".join(str(answer[k]) for k in keys if answer.get(k)) or "no reason given"


def _failed_call(base: str, error: Exception) -> str:
    if isinstance(error, urllib.error.URLError):
        return f"nothing answers on {base} ({error.reason})"
    return f"{base} answered badly: {error}"


def await_ready(base: str, headers: dict, timeout: float, wait: float = 0.0) -> None:
    """Return once /ready answers 200; Unhealthy with the last answer when it does not. While
    the engine is starting (nothing listens yet, or 503) it is asked again until `wait` seconds
    have passed; any other answer is final at once."""
    deadline, pause = time.monotonic() + wait, FIRST_PAUSE_S
    while True:
        try:
            status, ready = call(base + "/ready", headers, timeout)
        except (OSError, ValueError) as error:  # URLError (nothing listens) is an OSError
            problem, starting = _failed_call(base, error), isinstance(error, OSError)
        else:
            if status == 200:
                return
            problem = f"/ready answered {status} ({_reason(ready, 'status', 'error')})"
            starting = status == 503
        if not starting or time.monotonic() + pause > deadline:
            raise Unhealthy(problem)
        time.sleep(pause)
        pause = min(pause * 2, LAST_PAUSE_S)


def probe(port: int, headers: dict, timeout: float, wait: float = 0.0) -> dict:
    """The engine's answer as a dict (text, usage, key_installed, key_required); Unhealthy when
    it is not ready (within `wait` seconds), does not generate, or ignores the installed key."""
    base = f"http://127.0.0.1:{port}"
    await_ready(base, headers, timeout, wait)
    try:
        body = {"prompt": "Hello", "max_tokens": 4, "temperature": 0}
        status, answer = call(base + "/v1/completions", headers, timeout, body)
        open_status, _ = call(base + "/v1/models", JSON_HEADERS, timeout)
    except (OSError, ValueError) as error:
        raise Unhealthy(_failed_call(base, error)) from None
    if status != 200:
        raise Unhealthy(f"/v1/completions answered {status} ({_error_message(answer)})")
    choices, usage = answer.get("choices") or [{}], answer.get("usage") or {}
    if not isinstance(choices[0].get("text"), str) or not usage.get("completion_tokens"):
        raise Unhealthy(
            f"/v1/completions answered without text or usage: {json.dumps(answer)[:200]}"
        )
    key_installed, key_required = "Authorization" in headers, open_status == 401
    if key_installed and not key_required:
        raise Unhealthy(
            f"the engine ignores the installed API key: /v1/models answered {open_status} "
            "without it"
        )
    return {
        "text": choices[0]["text"],
        "usage": usage,
        "key_installed": key_installed,
        "key_required": key_required,
    }


def _error_message(answer: dict) -> str:
    error = answer.get("error")
    return (error.get("message") if isinstance(error, dict) else None) or "no reason given"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("port", type=int)
    parser.add_argument("env_file", help="the engine's env file, which may hold its API key")
    parser.add_argument("timeout", type=float, help="seconds each request may take")
    parser.add_argument("key_var", help="the API key's variable in the env file")
    parser.add_argument(
        "--wait", type=float, default=0.0, help="seconds to wait for an engine still starting"
    )
    args = parser.parse_args(argv)
    headers = bearer_headers(args.env_file, args.key_var)
    try:
        answer = probe(args.port, headers, args.timeout, args.wait)
    except Unhealthy as problem:
        print(problem)
        return 1
    print(json.dumps(answer))
    return 0


if __name__ == "__main__":
    sys.exit(main())
