"""Drive a running `sluice serve` with the official `openai` Python client (streaming and not).

    pip install openai
    sluice serve -m fixtures/qwen3_moe-q4g64 --port 8080 &
    python scripts/openai_client_check.py http://127.0.0.1:8080/v1

Checks that the client parses every response shape sluice produces: model list, chat and text completions,
streamed chunks with usage, and error bodies surfaced as the client's typed exceptions.
"""
import sys

import openai

base = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8080/v1"
client = openai.OpenAI(base_url=base, api_key="unused")

model = client.models.list().data[0].id
msgs = [{"role": "user", "content": "Name a fox."}]

whole = client.chat.completions.create(model=model, messages=msgs, max_tokens=8, temperature=0)
text = whole.choices[0].message.content
assert whole.usage.completion_tokens >= 1, whole

chunks = list(client.chat.completions.create(
    model=model, messages=msgs, max_tokens=8, temperature=0, stream=True, stream_options={"include_usage": True}))
streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
assert streamed == text, (streamed, text)
assert chunks[-1].usage.total_tokens == whole.usage.total_tokens, chunks[-1]

comp = client.completions.create(model=model, prompt="The quick brown fox", max_tokens=6, temperature=0)
pieces = client.completions.create(model=model, prompt="The quick brown fox", max_tokens=6, temperature=0, stream=True)
assert "".join(p.choices[0].text for p in pieces) == comp.choices[0].text

try:
    client.chat.completions.create(model="no-such-model", messages=msgs)
    raise SystemExit("expected NotFoundError")
except openai.NotFoundError as e:
    assert e.body["code"] == "model_not_found", e.body
try:
    client.chat.completions.create(model=model, messages=[])
    raise SystemExit("expected BadRequestError")
except openai.BadRequestError as e:
    assert "messages" in e.body["message"], e.body

print(f"openai {openai.__version__}: models, chat, completions (whole and streamed) and errors OK against {base}")
