"""The real `python -m engine serve` process with a tiny random Qwen3 + DFlash drafter, driven by
the official `openai` client and raw HTTP.

The target uses the byte-level tokenizer of tests/helpers/tiny_tokenizer.py, so its random output
splits multi-byte characters: streamed text must still equal the non-streamed text. One server
(with an API key) serves the whole module; its teardown checks that SIGTERM stops it cleanly.
Marked slow: starting a process that imports torch takes ~10 s idle, a minute on a loaded machine.
"""

from __future__ import annotations

import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.decode import GenerationConfig, generate
from engine.models import load_target
from engine.tokenizer import load_tokenizer
from tests.helpers.engine_server import start_engine_server
from tests.helpers.scripted_server import wait_until
from tests.helpers.tiny_pairs import save_byte_pair

MAX_MODEL_LEN = 256
PROMPT = "the cat sat on the mat"
METHODS = ["ar", "linear", "ddtree", "auto"]
API_KEY = "test-key-6f1d"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return save_byte_pair(tmp_path_factory.mktemp("engine-models"), "dense", name="tiny")


@pytest.fixture(scope="module")
def server(models):
    target, draft = models
    extra = ["--max-model-len", str(MAX_MODEL_LEN), "--budget", "6"]
    instance = start_engine_server(target, draft, api_key=API_KEY, extra_args=extra)
    yield instance
    # uvicorn shuts down gracefully, then re-raises SIGTERM (systemd counts that as clean).
    assert instance.stop() == -signal.SIGTERM
    log = instance.log_text()
    assert "Application shutdown complete" in log
    assert "Traceback" not in log
    assert API_KEY not in log


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def http(server) -> httpx.Client:
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=120) as session:
        yield session


def method_body(method: str) -> dict:
    return {"speculative": {"method": method}}


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == ["tiny"]


@pytest.mark.parametrize("method", METHODS)
def test_streamed_completion_equals_the_non_streamed_one(client, method):
    options = dict(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0)
    whole = client.completions.create(**options, extra_body=method_body(method))
    chunks = client.completions.create(**options, stream=True, extra_body=method_body(method))
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert whole.choices[0].text  # random weights, but something came out
    assert streamed == whole.choices[0].text
    assert whole.model_extra["speculative"]["method"] == method


def test_every_method_gives_the_same_greedy_text(client):
    texts = {
        method: client.completions.create(
            model="tiny",
            prompt=PROMPT,
            max_tokens=24,
            temperature=0,
            extra_body=method_body(method),
        )
        .choices[0]
        .text
        for method in METHODS
    }
    assert texts["linear"] == texts["ar"] == texts["ddtree"] == texts["auto"]


def test_greedy_output_equals_decode_generate_ar(models, client):
    target_dir, _ = models
    tokenizer = load_tokenizer(target_dir)
    cfg = GenerationConfig(
        method="ar", max_new_tokens=24, temperature=0.0, stop_token_ids=tokenizer.eos_token_ids
    )
    expected = generate(load_target(target_dir), None, tokenizer.encode(PROMPT), cfg)
    response = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=24, temperature=0, extra_body=method_body("ar")
    )
    ids = [t for t in expected.output_ids if t not in tokenizer.eos_token_ids]
    assert response.choices[0].text == tokenizer.decode(ids)
    assert response.usage.completion_tokens == len(expected.output_ids)
    assert response.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    assert response.choices[0].finish_reason == expected.finish_reason


def test_chat_streamed_equals_non_streamed(client):
    options = dict(
        model="tiny",
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        max_tokens=16,
        temperature=0,
    )
    whole = client.chat.completions.create(**options)
    chunks = list(client.chat.completions.create(**options, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert whole.choices[0].message.role == "assistant"
    assert streamed == whole.choices[0].message.content
    assert whole.usage.completion_tokens >= 1
    assert whole.model_extra["speculative"]["method"] == "auto"  # the default with a drafter
    assert whole.model_extra["speculative"]["budget"] == 6


def test_sampling_with_a_seed_repeats(client):
    options = dict(model="tiny", prompt=PROMPT, max_tokens=12, temperature=1.0, seed=3)
    first, second = (client.completions.create(**options).choices[0].text for _ in range(2))
    assert first == second


def test_tokenize_counts_like_the_tokenizer(models, http):
    tokenizer = load_tokenizer(models[0])
    text = http.post("/tokenize", json={"prompt": PROMPT}).json()
    assert text["tokens"] == tokenizer.encode(PROMPT)
    assert text["count"] == len(text["tokens"])
    messages = [{"role": "user", "content": "hi"}]
    chat = http.post("/tokenize", json={"messages": messages}).json()
    assert chat["tokens"] == tokenizer.apply_chat_template(messages)


def test_context_limit_is_exact(http):
    prompt_ids = [65] * (MAX_MODEL_LEN - 1)
    too_long = http.post("/v1/completions", json={"prompt": prompt_ids, "max_tokens": 2})
    assert too_long.status_code == 400
    expected = f"prompt has {MAX_MODEL_LEN - 1} tokens, max_tokens 2, limit {MAX_MODEL_LEN}"
    assert expected in too_long.json()["error"]["message"]
    fits = http.post("/v1/completions", json={"prompt": prompt_ids, "max_tokens": 1})
    assert fits.status_code == 200, fits.text
    assert fits.json()["usage"]["total_tokens"] == MAX_MODEL_LEN


@pytest.mark.parametrize(
    ("body", "status"),
    [
        (b"{", 400),
        (b'{"prompt": "x", "model": "other"}', 404),
        (b'{"prompt": "x", "max_tokens": -5}', 400),
        (b'{"prompt": "x", "temperature": "hot"}', 400),
        (b'{"messages": "hi"}', 400),
        # torch's generator takes 64 bits: this seed was a 500 that showed the exception
        (b'{"prompt": "x", "temperature": 1, "seed": 18446744073709551616}', 400),
    ],
)
def test_bad_requests_are_4xx_never_5xx(http, body, status):
    path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
    response = http.post(path, content=body)
    assert response.status_code == status, response.text
    assert response.json()["error"]["message"]


def test_a_body_over_the_default_limit_is_a_413(http):
    body = b'{"prompt": "' + b"x" * (9 << 20) + b'"}'  # 9 MiB: over the 8 MiB default
    response = http.post("/v1/completions", content=body)
    assert response.status_code == 413
    assert "at most 8388608 bytes" in response.json()["error"]["message"]


def test_a_dropped_stream_cancels_the_generation(http):
    def cancelled() -> float:
        return metric_value(http, "ddops_engine_generations_total", finish_reason="cancelled")

    before = cancelled()
    body = {"prompt": PROMPT, "max_tokens": 200, "stream": True, "speculative": {"method": "ar"}}
    with httpx.stream(
        "POST", str(http.base_url) + "/v1/completions", json=body, headers=http.headers
    ) as response:
        next(line for line in response.iter_lines() if line.startswith("data: {"))
    # Requests decode side by side: another may finish before the drop is seen. The dropped one
    # ends cancelled, never run to its 200 tokens ("length").
    wait_until(lambda: cancelled() == before + 1)


def test_metrics_parse_with_per_method_acceptance(client, http):
    client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=8, extra_body=method_body("ddtree")
    )
    rounds = metric_value(http, "ddops_engine_acceptance_length_count", method="ddtree")
    assert rounds >= 1
    assert metric_value(http, "ddops_engine_requests_total", method="ddtree") >= 1


def metric_value(http: httpx.Client, sample: str, **labels) -> float:
    text = http.get("/metrics").text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == sample and labels.items() <= s.labels.items()
    )


def test_the_api_key_is_required(server, http):
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.post(server.url + "/tokenize", json={"prompt": "x"}).status_code == 401
    assert httpx.get(server.url + "/health").status_code == 200  # probes need no key


def test_requests_at_once_share_passes_and_answer_as_they_would_alone(server, http):
    """Six greedy requests of every method (more than the server's slots) sent at once decode
    in shared passes (the batch-size histogram sees a pass of several) and each answers what it
    answers alone."""
    bodies = [
        {
            "prompt": f"{PROMPT} {index}",
            "max_tokens": 16,
            "temperature": 0,
            "cache_prompt": False,
            **method_body(method),
        }
        for index, method in enumerate(METHODS * 2)
    ]

    def answer(body: dict) -> str:
        with httpx.Client(base_url=server.url, headers=server.headers, timeout=120) as own:
            response = own.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            return response.json()["choices"][0]["text"]

    alone = [answer(body) for body in bodies]
    passes_before = metric_value(http, "ddops_engine_batch_size_count")
    single_before = metric_value(http, "ddops_engine_batch_size_bucket", le="1.0")
    with ThreadPoolExecutor(len(bodies)) as pool:
        together = list(pool.map(answer, bodies))
    assert together == alone
    passes = metric_value(http, "ddops_engine_batch_size_count") - passes_before
    single = metric_value(http, "ddops_engine_batch_size_bucket", le="1.0") - single_before
    assert passes > single  # some passes ran several sequences
    assert metric_value(http, "ddops_engine_inter_token_seconds_count", method="ddtree") >= 4
