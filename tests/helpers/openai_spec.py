"""OpenAI's own OpenAPI spec, trimmed to the endpoints the engine serves (tests/data/openai/).

The server's answers are checked against the spec's response schemas, and the request fields it
marks nullable are read from it. The carried file is made from the full spec (MIT, see
tests/data/openai/LICENSE) by

    python -m tests.helpers.openai_spec FULL_SPEC.json tests/data/openai/openapi.json

which keeps the served paths and every component they reference, without descriptions or
examples.
"""

from __future__ import annotations

import copy
import functools
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator

from tests.helpers import REPO

SPEC_PATH = REPO / "tests" / "data" / "openai" / "openapi.json"
SERVED = {
    "/chat/completions": ["post"],
    "/completions": ["post"],
    "/models": ["get"],
    "/models/{model}": ["get"],
    "/responses": ["post"],
}
_PROSE = ("description", "example", "examples", "x-oaiMeta", "x-oaiExpandable")


@functools.cache
def spec() -> dict:
    return json.loads(SPEC_PATH.read_text())


def served_spec_file(directory: Path) -> Path:
    """The spec as schemathesis should read it, written into `directory`. Two changes:

    - OpenAI's `text/event-stream` schemas describe each event's JSON payload, while OpenAPI
      3.2 (which schemathesis follows) reads them as the event object (`event`, `data`): each
      becomes an event whose `data` is that payload (`[DONE]`, chat's last, is a plain string).
    - the one difference the server keeps on purpose: with `echo`, nothing predicts the prompt's
      first token, so its `token_logprobs` and `top_logprobs` entries are null, as OpenAI and
      vLLM answer; the spec types them as a number and an object.
    """
    served = copy.deepcopy(spec())
    for operations in served["paths"].values():
        for operation in operations.values():
            for response in operation["responses"].values():
                stream = response.get("content", {}).get("text/event-stream")
                if stream is not None:
                    stream["schema"] = _sse_event(stream["schema"])
    choice = served["components"]["schemas"]["CreateCompletionResponse"]["properties"]["choices"]
    logprobs = choice["items"]["properties"]["logprobs"]["anyOf"][0]["properties"]
    for name in ("token_logprobs", "top_logprobs"):
        logprobs[name]["items"] = {"anyOf": [logprobs[name]["items"], {"type": "null"}]}
    path = directory / "openapi-as-served.json"
    path.write_text(json.dumps(served))
    return path


def _sse_event(payload: dict) -> dict:
    data = {"contentMediaType": "application/json", "contentSchema": payload}
    done = {"const": "[DONE]"}
    return {"type": "object", "required": ["data"], "properties": {"data": {"anyOf": [done, data]}}}


def validator(schema_name: str) -> Draft202012Validator:
    """A validator for one of the spec's component schemas (its references resolved)."""
    components = _nullable_as_null(spec()["components"])
    return Draft202012Validator(
        {"$ref": f"#/components/schemas/{schema_name}", "components": components}
    )


def _nullable_as_null(node: Any) -> Any:
    """OpenAPI 3.0's `nullable: true`, which the spec still uses, as JSON Schema's null type."""
    if isinstance(node, list):
        return [_nullable_as_null(value) for value in node]
    if not isinstance(node, dict):
        return node
    schema = {key: _nullable_as_null(value) for key, value in node.items() if key != "nullable"}
    if node.get("nullable") is True:
        return {"anyOf": [schema, {"type": "null"}]}
    return schema


def violations(schema_name: str, instance: Any) -> list[str]:
    return [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
        for e in validator(schema_name).iter_errors(instance)
    ]


def nullable_fields(schema_name: str) -> list[str]:
    """The properties of a request schema (allOf parts included) that accept null."""
    return sorted(name for name, prop in _properties(schema_name).items() if _accepts_null(prop))


def number_bounds(schema_name: str) -> dict[str, tuple[float, float]]:
    """(minimum, maximum) of each numeric property of a request schema that has both."""
    bounds = {}
    for name, prop in _properties(schema_name).items():
        for option in _options(prop):
            if option.get("type") in ("number", "integer") and {"minimum", "maximum"} <= set(
                option
            ):
                bounds[name] = (option["minimum"], option["maximum"])
    return bounds


def _options(prop: dict) -> Iterator[dict]:
    prop = _resolve(prop)
    yield prop
    for option in prop.get("anyOf", []) + prop.get("oneOf", []):
        yield from _options(option)


def _properties(schema_name: str) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for part in _parts(spec()["components"]["schemas"][schema_name]):
        found.update(part.get("properties", {}))
    return found


def _parts(schema: dict) -> Iterator[dict]:
    schema = _resolve(schema)
    yield schema
    for part in schema.get("allOf", []):
        yield from _parts(part)


def _resolve(schema: dict) -> dict:
    while "$ref" in schema:
        schema = spec()["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
    return schema


def _accepts_null(prop: dict) -> bool:
    prop = _resolve(prop)
    if prop.get("nullable") or prop.get("type") == "null":
        return True
    return any(_accepts_null(option) for option in prop.get("anyOf", []) + prop.get("oneOf", []))


# -- making the carried file ------------------------------------------------------------------


def trim(full: dict) -> dict:
    paths = {path: {m: full["paths"][path][m] for m in methods} for path, methods in SERVED.items()}
    kept: set[tuple[str, str]] = set()
    todo: list[Any] = [paths]
    while todo:
        for ref in _references(todo.pop()):
            _, _, kind, name = ref.split("/")
            if (kind, name) not in kept:
                kept.add((kind, name))
                todo.append(full["components"][kind][name])
    components: dict[str, dict] = {}
    for kind, name in sorted(kept):
        components.setdefault(kind, {})[name] = full["components"][kind][name]
    trimmed = {"openapi": full["openapi"], "info": full["info"], "paths": paths}
    return _without_prose({**trimmed, "components": components})


def _references(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                yield value
            else:
                yield from _references(value)
    elif isinstance(node, list):
        for value in node:
            yield from _references(value)


def _without_prose(node: Any, *, names: bool = False) -> Any:
    """`node` less its descriptions and examples (`names`: node's keys are property names)."""
    if isinstance(node, list):
        return [_without_prose(value) for value in node]
    if not isinstance(node, dict):
        return node
    return {
        key: _without_prose(value, names=key == "properties" and not names)
        for key, value in node.items()
        if names or key not in _PROSE
    }


if __name__ == "__main__":
    source, target = sys.argv[1:3]
    Path(target).write_text(json.dumps(trim(json.loads(Path(source).read_text())), indent=1) + "\n")
