"""The official openai client against `iterserve serve smollm2-135m`: a real answer, streamed and not."""
from __future__ import annotations

import openai
import pytest

from iterserve.bench.launcher import ServerProcess

pytestmark = [pytest.mark.real_model, pytest.mark.slow]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    log = tmp_path_factory.mktemp("real-server") / "server.log"
    with ServerProcess(["smollm2-135m", "--max-model-len", "512"], log_path=log) as srv:
        yield openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0)


def test_chat_answers_capital_of_france(client):
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    out = client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=16, temperature=0)
    assert "paris" in out.choices[0].message.content.lower()
    assert out.choices[0].finish_reason in ("stop", "length")
    stream = client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=16, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == out.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == out.usage.completion_tokens
