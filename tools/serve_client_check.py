"""Checks a running `kvflow serve graphs/smollm2.toml` with the clients people use: the `openai`
Python client (chat and completions, whole and streamed, a bad request) and prometheus_client's
text-format parser on /metrics. Expected tokens and text come from fixtures/smollm2/expected.json
(tools/smollm2_reference.py). Prints `completed=N` (the server's completed count) at the end.

    python3 tools/serve_client_check.py http://127.0.0.1:8000 fixtures/smollm2/expected.json
"""

import json
import sys
import urllib.request

import openai
from prometheus_client.parser import text_string_to_metric_families

MODEL = "SmolLM2-135M-Instruct"


def expect(what, got, want):
    if got != want:
        sys.exit(f"{what}: got {got!r}, expected {want!r}")


def main():
    base, expected_path = sys.argv[1], sys.argv[2]
    cases = json.load(open(expected_path))["cases"]
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=300)
    expect("models", [m.id for m in client.models.list().data], [MODEL])
    done = 0

    chat = next(c for c in cases if c["kind"] == "chat" and c["eos_at"] is not None)
    reply = client.chat.completions.create(
        model=MODEL, messages=chat["messages"], max_tokens=len(chat["greedy"]), temperature=0
    )
    expect("chat text", reply.choices[0].message.content, chat["text"])
    expect("chat finish", reply.choices[0].finish_reason, "stop")
    expect("chat usage", (reply.usage.prompt_tokens, reply.usage.completion_tokens),
           (len(chat["prompt"]), chat["eos_at"] + 1))
    done += 1

    pieces, usage, finish = [], None, None
    for chunk in client.chat.completions.create(
        model=MODEL, messages=chat["messages"], max_tokens=len(chat["greedy"]), temperature=0,
        stream=True, stream_options={"include_usage": True},
    ):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    expect("streamed chat text", "".join(pieces), chat["text"])
    expect("streamed chat finish", finish, "stop")
    expect("streamed chat usage", usage.completion_tokens, chat["eos_at"] + 1)
    done += 1

    completion = next(c for c in cases if c["kind"] == "completion")
    n = len(completion["greedy"])
    reply = client.completions.create(model=MODEL, prompt=completion["rendered"], max_tokens=n, temperature=0)
    expect("completion text", reply.choices[0].text, completion["text"])
    expect("completion finish", reply.choices[0].finish_reason, "length")
    expect("completion usage", (reply.usage.prompt_tokens, reply.usage.completion_tokens),
           (len(completion["prompt"]), n))
    done += 1

    text = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=MODEL, prompt=completion["rendered"], max_tokens=n, temperature=0, stream=True
        )
    )
    expect("streamed completion text", text, completion["text"])
    done += 1

    try:
        client.completions.create(model=MODEL, prompt="x", max_tokens=0)
        sys.exit("max_tokens = 0 was accepted")
    except openai.BadRequestError as e:
        expect("bad request param", e.body.get("param"), "max_tokens")

    metrics = urllib.request.urlopen(base + "/metrics").read().decode()
    samples = {}
    for family in text_string_to_metric_families(metrics):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    completed = samples[("kvflow:requests_total", (("outcome", "completed"),))]
    expect("completed requests in /metrics", completed, done)
    expect("TTFT observations", samples[("vllm:time_to_first_token_seconds_count", ())], done)
    expect("refused with 400", samples[("kvflow:http_requests_refused_total", (("status", "400"),))], 1)
    print(f"openai client and prometheus parser: ok; completed={int(completed)}")


if __name__ == "__main__":
    main()
