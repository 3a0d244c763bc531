"""kvguard-serve as a real OpenAI SDK client sees it (the ``openai`` package, not hand-made
JSON): model list, completions (plain and streamed), chat completions, a per-request prefix-cache
namespace, and a bad request that gets a clear error while the server keeps serving."""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def client(shared_server):
    srv = shared_server.get()  # the session's kvguard-serve (tests/shared_server.py)
    c = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120)
    yield c
    c.close()


def _model(client) -> str:
    return client.models.list().data[0].id


def test_models_and_completions(client):
    model = _model(client)
    out = client.completions.create(model=model, prompt="def fib(n):", max_tokens=12, temperature=0)
    assert out.choices[0].text and out.usage.completion_tokens == 12
    again = client.completions.create(
        model=model, prompt="def fib(n):", max_tokens=12, temperature=0
    )
    assert again.choices[0].text == out.choices[0].text  # greedy, through the prefix cache


def test_streamed_completion_matches_the_plain_one(client):
    model = _model(client)
    plain = client.completions.create(
        model=model, prompt="import os\n", max_tokens=10, temperature=0
    )
    parts = client.completions.create(
        model=model, prompt="import os\n", max_tokens=10, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in parts if c.choices) == plain.choices[0].text


def test_chat_completion(client):
    out = client.chat.completions.create(
        model=_model(client),
        messages=[{"role": "user", "content": "a function that adds two numbers"}],
        max_tokens=16,
        temperature=0,
    )
    assert out.choices[0].message.content and out.usage.completion_tokens == 16


def test_tenant_namespace_is_accepted(client):
    out = client.completions.create(
        model=_model(client), prompt="class A:\n", max_tokens=6, temperature=0,
        extra_body={"cache_salt": "tenant-a"},
    )  # fmt: skip
    assert out.choices[0].text


def test_bad_request_is_a_clear_error_and_the_server_goes_on(client):
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=_model(client), prompt="x", max_tokens=-5)
    assert exc.value.status_code == 400
    assert (
        client.completions.create(model=_model(client), prompt="x", max_tokens=2).choices[0].text
        is not None
    )
