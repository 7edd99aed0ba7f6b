"""Sends the same 20 chat prompts (greedy, 96 tokens at most) to two OpenAI-compatible servers
and compares the texts: the first is the reference (kvflow's CPU executor), the second is checked
(its cuda executor), once whole and once streamed. Standard library only (the device machine
reaches no registry). Usage: serve_compare.py REFERENCE_URL CHECKED_URL. Exits 1 on any
difference, 2 when a server never comes up."""

import json
import sys
import time
import urllib.request

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "List three prime numbers greater than 100.",
    "Translate 'good morning' into Spanish and German.",
    "What is 17 times 23?",
    "Give me a Python function that reverses a string.",
    "Who wrote Pride and Prejudice?",
    "Describe a cat to someone who has never seen one.",
    "Why is the sky blue?",
    "Summarise the plot of Romeo and Juliet in two sentences.",
    "What are the three states of matter?",
    "Suggest a name for a bakery.",
    "How many days are there in a leap year?",
    "Write a limerick about a programmer.",
    "What does HTTP stand for?",
    "Name four planets of the solar system.",
    "Écris une phrase en français sur le printemps.",
    "What is the boiling point of water at sea level, in Celsius and Fahrenheit?",
    "Give one tip for writing clear code.",
]


def post(url, body, stream=False):
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        if not stream:
            return json.load(resp)["choices"][0]["message"]["content"]
        text = ""
        for line in resp:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            delta = json.loads(line[6:])["choices"][0].get("delta", {})
            text += delta.get("content") or ""
        return text


def wait_ready(url, deadline_s=300):
    start = time.time()
    while time.time() - start < deadline_s:
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as resp:
                if resp.status == 200:
                    return True
        except Exception:
            time.sleep(1)
    return False


def main():
    reference, checked = sys.argv[1], sys.argv[2]
    for url in (reference, checked):
        if not wait_ready(url):
            print(f"{url}: no answer on /health within 300 s")
            return 2
    differ = 0
    for i, prompt in enumerate(PROMPTS):
        body = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": prompt}],
                "temperature": 0, "max_tokens": 96}
        want = post(reference, body)
        got = post(checked, body)
        streamed = post(checked, dict(body, stream=True), stream=True)
        same = got == want and streamed == want
        differ += not same
        print(f"[{i + 1:2}] {'same' if same else 'DIFFERENT'}: {prompt!r}")
        print(f"     cpu : {want!r}")
        if not same:
            print(f"     cuda: {got!r}")
            print(f"     cuda streamed: {streamed!r}")
    print(f"{len(PROMPTS) - differ} of {len(PROMPTS)} chat prompts: the same text on cuda (whole and streamed) "
          "as on the cpu executor")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
