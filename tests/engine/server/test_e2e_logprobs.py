"""Logprobs and `n` behind a real `python -m engine serve` of the demo pair, through the openai
client and LangChain: greedy logprobs equal under ar, linear and ddtree, streamed as whole; the
prompt's logprobs (completions' echo) are the target's own; `n: 3` with a seed gives three
answers, the same on every run, the prompt prefilled once (the prefix cache holds it for the
second and third).

Marked slow: starting a process that imports torch takes ~10 s idle, a minute on a loaded machine.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch
from langchain_openai import ChatOpenAI
from prometheus_client.parser import text_string_to_metric_families

from engine.models import load_target
from engine.tokenizer import load_tokenizer

pytestmark = pytest.mark.slow

DEMO = Path(__file__).resolve().parents[3] / "engine" / "demo_model"
METHODS = ("ar", "linear", "ddtree")
ASK = [{"role": "user", "content": "Name three colours."}]
TOL = 2e-4  # float32 logits of passes of different shapes


def chat_logprobs(client, method: str, **options):
    return client.chat.completions.create(
        model="target",
        messages=ASK,
        max_tokens=16,
        temperature=0,
        logprobs=True,
        top_logprobs=4,
        extra_body={"speculative": {"method": method}},
        **options,
    )


def test_greedy_logprobs_are_equal_under_every_method_and_streamed(client):
    answers = {method: chat_logprobs(client, method).choices[0] for method in METHODS}
    ar = answers["ar"].logprobs.content
    assert "".join(t.token for t in ar) == answers["ar"].message.content
    for method in ("linear", "ddtree"):
        got = answers[method].logprobs.content
        assert [t.token for t in got] == [t.token for t in ar]
        assert [t.logprob for t in got] == pytest.approx([t.logprob for t in ar], abs=TOL)
        assert [[a.token for a in t.top_logprobs] for t in got][:3] == [
            [a.token for a in t.top_logprobs] for t in ar
        ][:3]
    chunks = list(chat_logprobs(client, "ddtree", stream=True))
    streamed = [
        t
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.content
    ]
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in ar], abs=TOL)


def test_the_prompts_logprobs_are_the_targets_own(client):
    prompt = "The sky is"
    answer = client.completions.create(
        model="target", prompt=prompt, max_tokens=4, temperature=0, echo=True, logprobs=2
    ).choices[0]
    tokenizer = load_tokenizer(DEMO / "target")
    ids = tokenizer.encode(prompt)
    target = load_target(DEMO / "target")
    logits, _ = target.forward(torch.tensor(ids), target.new_cache(len(ids) + 1))
    reference = logits.log_softmax(-1)
    expected = [reference[i - 1, ids[i]].item() for i in range(1, len(ids))]
    got = answer.logprobs.token_logprobs
    assert got[0] is None and got[1 : len(ids)] == pytest.approx(expected, abs=TOL)
    assert answer.text.startswith(prompt)
    assert "".join(answer.logprobs.tokens[: len(ids)]) == prompt


def prefix_hits(url: str) -> float:
    families = text_string_to_metric_families(httpx.get(url + "/metrics").text)
    hits = next(f for f in families if f.name == "ddops_engine_prefix_cache_hits")
    return sum(s.value for s in hits.samples if s.name.endswith("_total"))


def test_n_seeded_answers_repeat_and_share_one_prefill(client, server_process):
    options = dict(model="target", messages=ASK, max_tokens=12, temperature=1.0, seed=5, n=3)
    before = prefix_hits(server_process.url)
    first = client.chat.completions.create(**options)
    hits = prefix_hits(server_process.url) - before
    prompt = first.usage.prompt_tokens
    assert hits >= 2 * prompt  # the second and third sequences found the whole prompt cached
    again = client.chat.completions.create(**options)
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert texts == [c.message.content for c in again.choices]
    assert len(set(texts)) > 1  # each its own seed


def test_langchain_reads_the_logprobs_whole_and_streamed(server_process):
    model = ChatOpenAI(
        base_url=server_process.url + "/v1",
        api_key="none",
        model="target",
        temperature=0,
        max_tokens=8,
        logprobs=True,
        top_logprobs=2,
    )
    message = model.invoke("Hi")
    content = message.response_metadata["logprobs"]["content"]
    assert "".join(t["token"] for t in content) == message.content
    streamed = list(model.stream("Hi"))
    tokens = [
        t["token"]
        for c in streamed
        if c.response_metadata.get("logprobs")
        for t in c.response_metadata["logprobs"]["content"]
    ]
    assert "".join(tokens) == message.content
