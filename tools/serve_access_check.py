"""Checks a running `kvflow serve --ssl-certfile ... --ssl-keyfile ... --api-key KEY` with the
`openai` Python client, over HTTPS verified against the test's own certificate authority: the
certificate is accepted with that authority and refused without it; /v1/* answers 401 without the
key or with a wrong one (an OpenAI error object, code invalid_api_key) and 200 with it; /health
stays open. Prints `ok` at the end. (tests/integration/serve_access.rs runs it.)

    python3 tools/serve_access_check.py https://127.0.0.1:PORT CA.pem KEY
"""

import ssl
import sys

import openai


def expect(what, got, want):
    if got != want:
        sys.exit(f"{what}: got {got!r}, expected {want!r}")


def main():
    base, ca, key = sys.argv[1], sys.argv[2], sys.argv[3]
    trusting = ssl.create_default_context(cafile=ca)

    def client(api_key, verify=trusting):
        http = openai.DefaultHttpxClient(verify=verify)
        return openai.OpenAI(base_url=base + "/v1", api_key=api_key, max_retries=0, timeout=120, http_client=http)

    served = client(key)
    models = [m.id for m in served.models.list().data]
    expect("models", len(models), 1)
    reply = served.completions.create(model=models[0], prompt=[1, 2, 3], max_tokens=4, temperature=0)
    expect("completion tokens", reply.usage.completion_tokens, 4)

    try:
        client("not-the-key").models.list()
        sys.exit("a wrong key was accepted")
    except openai.AuthenticationError as e:
        expect("wrong key status", e.status_code, 401)
        expect("wrong key code", e.body.get("code"), "invalid_api_key")

    raw = openai.DefaultHttpxClient(verify=trusting)
    answer = raw.get(base + "/v1/models")
    expect("no key status", answer.status_code, 401)
    expect("no key code", answer.json()["error"]["code"], "invalid_api_key")
    expect("health without a key", raw.get(base + "/health").status_code, 200)
    expect("metrics without a key", raw.get(base + "/metrics").status_code, 200)

    try:
        client(key, verify=ssl.create_default_context()).models.list()
        sys.exit("the test certificate was accepted without its authority")
    except openai.APIConnectionError as e:
        cause = repr(e.__cause__)
        if "CERTIFICATE_VERIFY_FAILED" not in cause:
            sys.exit(f"refused for another reason than the certificate: {cause}")
    print("ok")


if __name__ == "__main__":
    main()
