"""The prefix cache as the HTTP API shows it, over a scripted engine that reports cached tokens:
`usage.prompt_tokens_details.cached_tokens` (streamed usage too), the `cache_prompt` body
field, the checkpoint where a chat's messages end, and the queried and hit token counters.
The real engine's reuse is tested in tests/engine/test_prefix_cache.py and, served,
in tests/engine/server/test_e2e_prefix_cache.py.
"""

from __future__ import annotations

import json
from dataclasses import replace

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.scripted_server import WAIT_S, ScriptedEngine, complete, loaded, running


class CachingEngine(ScriptedEngine):
    """Reports the first half of each prompt as cached, unless the request said cache_prompt false."""

    def generate(self, prompt_ids, cfg, **callbacks):
        result = super().generate(prompt_ids, cfg, **callbacks)
        return replace(result, cached_tokens=len(prompt_ids) // 2 if cfg.cache_prompt else 0)


@pytest.fixture
def caching(request):
    engine = CachingEngine()
    on = getattr(request, "param", True)
    load = lambda: replace(loaded(engine), prefix_caching=on)  # noqa: E731
    with running(engine, load=load) as (url, state):
        assert state.worker.ready.wait(WAIT_S)
        yield url, engine


def counters(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith("ddops_engine_prefix_cache") and sample.name.endswith("_total")
    }


def test_cached_tokens_are_in_the_usage_streamed_or_not(caching):
    url, _ = caching
    body = complete(url, prompt="0123456789").json()
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 5}
    stream = {"prompt": "0123456789", "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url + "/v1/completions", json=stream, timeout=WAIT_S) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if line[6:7] == "{"]
    assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 5}
    chat = {"messages": [{"role": "user", "content": "hello"}]}
    answer = httpx.post(url + "/v1/chat/completions", json=chat, timeout=WAIT_S).json()
    prompt_tokens = answer["usage"]["prompt_tokens"]
    assert answer["usage"]["prompt_tokens_details"] == {"cached_tokens": prompt_tokens // 2}
    responses = httpx.post(url + "/v1/responses", json={"input": "hello"}, timeout=WAIT_S)
    usage = responses.json()["usage"]
    assert usage["input_tokens_details"] == {
        "cached_tokens": usage["input_tokens"] // 2,
        "cache_write_tokens": 0,
    }


def test_cache_prompt_false_reaches_the_engine_and_must_be_a_boolean(caching):
    url, engine = caching
    complete(url)
    assert engine.configs[-1].cache_prompt is True
    off = complete(url, prompt="0123456789", cache_prompt=False).json()
    assert engine.configs[-1].cache_prompt is False
    assert off["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    refused = complete(url, cache_prompt="no")
    assert refused.status_code == 400 and "cache_prompt" in refused.text


def test_a_chat_prompt_is_checkpointed_where_its_messages_end(caching):
    url, engine = caching
    chat = {
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    }
    assert httpx.post(url + "/v1/chat/completions", json=chat, timeout=WAIT_S).is_success
    assert engine.configs[-1].checkpoints == (len("[system]be brief[user]hi"),)  # not [assistant]
    off = {**chat, "cache_prompt": False}
    assert httpx.post(url + "/v1/chat/completions", json=off, timeout=WAIT_S).is_success
    assert engine.configs[-1].checkpoints == ()


def test_the_counters_count_queried_and_hit_tokens(caching):
    url, _ = caching
    complete(url, prompt="0123456789")
    complete(url, prompt="abcdefgh", cache_prompt=False)  # asked nothing of the cache
    assert counters(url) == {
        "ddops_engine_prefix_cache_queries_total": 10.0,
        "ddops_engine_prefix_cache_hits_total": 5.0,
    }


@pytest.mark.parametrize("caching", [False], indirect=True)
def test_a_server_without_the_cache_counts_no_queries(caching):
    url, engine = caching
    complete(url, prompt="0123456789")
    assert counters(url)["ddops_engine_prefix_cache_queries_total"] == 0.0
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert httpx.post(url + "/v1/chat/completions", json=chat, timeout=WAIT_S).is_success
    assert engine.configs[-1].checkpoints == ()
