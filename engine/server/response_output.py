"""Chat deltas -> the Responses API's output items, and the stream events that build them.

A generation's text is parsed by chat's `ChatOutput` (reasoning, content, tool calls); each of
its deltas lands here. A `reasoning_content` run becomes a `reasoning` item (its text in a
`reasoning_text` part), a `content` run a `message` item (one `output_text` part), each tool
call a `function_call` item. The events are the ones the openai SDK and the Agents SDK read:

    response.output_item.added
      response.content_part.added                       (message, reasoning)
        response.output_text.delta | response.reasoning_text.delta | ...arguments.delta
      response.output_text.done | response.reasoning_text.done | ...arguments.done
      response.content_part.done
    response.output_item.done

The non-streamed response's `output` is the same items (`OutputItems.items`), built from the
same deltas, so both agree. With `include: ["message.output_text.logprobs"]` the logprobs of the
tokens behind each content delta ride on its `output_text` delta and gather in the part's
`logprobs` (engine/server/logprobs.py's shape); a call the token limit cut is a
`function_call` item with status "incomplete".
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from engine.server.logprobs import LogprobShapes

_KINDS = {"reasoning_content": "reasoning", "content": "message"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputItems:
    """The output items of one response, and the events (no sequence numbers) that build them."""

    def __init__(self, shapes: LogprobShapes | None = None) -> None:
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the reasoning or message item taking text
        self._shapes = shapes  # None: no logprobs asked

    def add(
        self, delta: dict[str, Any], logprobs: Sequence = (), complete: bool = True
    ) -> list[dict[str, Any]]:
        """The events for one chat delta; `logprobs`: the TokenLogprobs behind it (a content
        delta's are kept); `complete` False: its calls were cut by the token limit."""
        if "tool_calls" in delta:
            events = self._close("completed")
            for call in delta["tool_calls"]:
                events += self._function_call(call, "completed" if complete else "incomplete")
            return events
        ((key, text),) = delta.items()
        kind = _KINDS[key]
        events = []
        if self._open is None or self._open["type"] != kind:
            events = self._close("completed") + self._open_item(kind)
        part = self._open["content"][0]
        part["text"] += text
        if kind != "message":
            return [*events, self._text_event("delta", delta=text)]
        shaped = self._shapes.chat(logprobs) if self._shapes else []
        part["logprobs"] = part["logprobs"] + shaped  # a new list: sent events keep theirs
        return [*events, self._text_event("delta", delta=text, logprobs=shaped)]

    def finish(self, status: str) -> list[dict[str, Any]]:
        """The events that close the last item: `status` "completed", or "incomplete" when the
        generation was cut short."""
        return self._close(status)

    # -- items --------------------------------------------------------------------------------

    def _open_item(self, kind: str) -> list[dict[str, Any]]:
        if kind == "message":
            item = {"id": new_id("msg"), "type": "message", "role": "assistant", "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item = {"id": new_id("rs"), "type": "reasoning", "summary": [], "content": []}
            part = {"type": "reasoning_text", "text": ""}
        item["status"] = "in_progress"
        self.items.append(item)
        added = self._item_event("added", item)
        item["content"].append(part)
        self._open = item
        return [added, self._part_event("added", {**part})]

    def _close(self, status: str) -> list[dict[str, Any]]:
        item, self._open = self._open, None
        if item is None:
            return []
        item["status"] = status
        part = item["content"][0]
        logprobs = {"logprobs": list(part["logprobs"])} if "logprobs" in part else {}
        return [
            self._text_event("done", item, text=part["text"], **logprobs),
            self._part_event("done", {**part}, item),
            self._item_event("done", item),
        ]

    def _function_call(self, call: dict[str, Any], status: str) -> list[dict[str, Any]]:
        function = call["function"]
        item = {
            "id": new_id("fc"),
            "type": "function_call",
            "status": "in_progress",
            "call_id": call["id"],
            "name": function["name"],
            "arguments": "",
        }
        self.items.append(item)
        added = self._item_event("added", item)
        arguments = function["arguments"]
        where = {"item_id": item["id"], "output_index": len(self.items) - 1}
        item.update(arguments=arguments, status=status)
        return [
            added,
            {"type": "response.function_call_arguments.delta", **where, "delta": arguments},
            {
                "type": "response.function_call_arguments.done",
                **where,
                "name": function["name"],
                "arguments": arguments,
            },
            self._item_event("done", item),
        ]

    # -- events -------------------------------------------------------------------------------

    def _item_event(self, stage: str, item: dict[str, Any]) -> dict[str, Any]:
        index = _index(self.items, item)
        return {"type": f"response.output_item.{stage}", "output_index": index, "item": _copy(item)}

    def _part_event(
        self, stage: str, part: dict[str, Any], item: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        return {"type": f"response.content_part.{stage}", **self._where(item), "part": part}

    def _text_event(self, stage: str, item: dict[str, Any] | None = None, **fields) -> dict:
        item = item or self._open
        kind = "output_text" if item["type"] == "message" else "reasoning_text"
        logprobs = {"logprobs": []} if kind == "output_text" else {}
        return {"type": f"response.{kind}.{stage}", **self._where(item), **logprobs, **fields}

    def _where(self, item: dict[str, Any] | None) -> dict[str, Any]:
        item = item or self._open
        where = {"item_id": item["id"], "output_index": _index(self.items, item)}
        return {**where, "content_index": 0}


def _index(items: list[dict[str, Any]], item: dict[str, Any]) -> int:
    return next(i for i, candidate in enumerate(items) if candidate is item)


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    """A snapshot of `item` (its parts copied): later text must not change a sent event."""
    return {
        **item,
        **({"content": [dict(p) for p in item["content"]]} if "content" in item else {}),
    }
