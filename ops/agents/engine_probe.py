#!/usr/bin/env python3
"""The engine's health probe: run inside a container by the engine's Python. Stdlib only.

    pct exec 200 -- /opt/ddops/venv/bin/python - 8000 /etc/ddops/engine.env 30 DDOPS_API_KEY \
        < ops/agents/engine_probe.py

1. GET /ready must answer 200;
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
import urllib.error
import urllib.request

JSON_HEADERS = {"Content-Type": "application/json"}


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


def probe(port: int, headers: dict, timeout: float) -> dict:
    """The engine's answer as a dict (text, usage, key_installed, key_required); Unhealthy when
    it is not ready, does not generate, or ignores the installed key."""
    base = f"http://127.0.0.1:{port}"
    try:
        status, ready = call(base + "/ready", headers, timeout)
        if status != 200:
            raise Unhealthy(f"/ready answered {status} ({_reason(ready, 'status', 'error')})")
        body = {"prompt": "Hello", "max_tokens": 4, "temperature": 0}
        status, answer = call(base + "/v1/completions", headers, timeout, body)
        open_status, _ = call(base + "/v1/models", JSON_HEADERS, timeout)
    except urllib.error.URLError as error:
        raise Unhealthy(f"nothing answers on {base} ({error.reason})") from None
    except (OSError, ValueError) as error:
        raise Unhealthy(f"{base} answered badly: {error}") from None
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
    args = parser.parse_args(argv)
    try:
        answer = probe(args.port, bearer_headers(args.env_file, args.key_var), args.timeout)
    except Unhealthy as problem:
        print(problem)
        return 1
    print(json.dumps(answer))
    return 0


if __name__ == "__main__":
    sys.exit(main())
