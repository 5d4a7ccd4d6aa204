"""The official `openai` client against the server: completions and chat, streaming and not."""
from __future__ import annotations

import openai
import pytest


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_models(client):
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_completion(client):
    out = client.completions.create(model="tiny", prompt="The capital of France is", max_tokens=8,
                                    temperature=0)
    assert out.object == "text_completion"
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 8
    assert out.usage.prompt_tokens == 5
    assert out.usage.total_tokens == 13
    assert out.choices[0].text


def test_streamed_completion_matches_unstreamed(client):
    kwargs = dict(model="tiny", prompt="Once upon a time", max_tokens=12, temperature=0)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].choices == []


def test_chat(client):
    out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi there"}],
                                         max_tokens=6, temperature=0)
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 6


def test_chat_stream(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages,
                                                 max_tokens=10, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_seeded_sampling_is_reproducible(client):
    kwargs = dict(model="tiny", prompt="Pick a word:", max_tokens=8, temperature=1.0, top_p=0.9, seed=1234)
    first = client.completions.create(**kwargs).choices[0].text
    assert client.completions.create(**kwargs).choices[0].text == first


def test_stop_string_trims_and_stops(client):
    base = client.completions.create(model="tiny", prompt="Count:", max_tokens=20,
                                     temperature=0).choices[0].text
    stop = base[5:8]
    assert stop and base.find(stop) >= 0
    cut = base.find(stop)
    out = client.completions.create(model="tiny", prompt="Count:", max_tokens=20, temperature=0, stop=[stop])
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == base[:cut]
    streamed = client.completions.create(model="tiny", prompt="Count:", max_tokens=20,
                                         temperature=0, stop=stop, stream=True)
    chunks = [c.choices[0] for c in streamed if c.choices]
    assert "".join(c.text for c in chunks) == base[:cut]
    assert chunks[-1].finish_reason == "stop"


def test_token_id_prompt_and_batch_of_prompts(client):
    out = client.completions.create(model="tiny", prompt=[[1, 2, 3, 4], [5, 6, 7]],
                                    max_tokens=3, temperature=0)
    assert [c.index for c in out.choices] == [0, 1]
    assert out.usage.prompt_tokens == 7 and out.usage.completion_tokens == 6
