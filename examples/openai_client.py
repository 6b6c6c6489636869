"""Talk to `k3 serve` with the official OpenAI Python client.

    k3 serve runs/x/final --port 8000            # in another terminal (add --api-key KEY to require a key)
    python examples/openai_client.py --base-url http://127.0.0.1:8000/v1

Shows model discovery, a chat completion, streaming with usage, extra sampling fields (top_k, min_p) through
extra_body, and loglikelihood scoring with echo + logprobs.
"""

from __future__ import annotations

import argparse

from openai import OpenAI


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--api-key", default="none", help="the server's --api-key, if it has one")
    args = ap.parse_args()
    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    model = client.models.list().data[0].id
    print(f"model: {model}")

    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Write a haiku."}],
                                       max_tokens=40, temperature=0.7, seed=1)
    print("chat:", r.choices[0].message.content, "|", r.usage)

    print("stream: ", end="")
    stream = client.completions.create(model=model, prompt="def fibonacci(n):", max_tokens=40, stream=True,
                                       stream_options={"include_usage": True}, temperature=0.8,
                                       extra_body={"top_k": 40, "min_p": 0.05})
    for chunk in stream:
        if chunk.choices:
            print(chunk.choices[0].text, end="", flush=True)
        elif chunk.usage:
            print(f"\n[usage: {chunk.usage.completion_tokens} tokens, "
                  f"{chunk.usage.prompt_tokens_details.cached_tokens} prompt tokens from the prefix cache]")

    scored = client.completions.create(model=model, prompt="import os\nprint(os.getcwd())", max_tokens=0,
                                       echo=True, logprobs=1)
    lp = scored.choices[0].logprobs
    total = sum(x for x in lp.token_logprobs if x is not None)
    print(f"loglikelihood of the prompt: {total:.2f} over {len(lp.tokens) - 1} predicted tokens")


if __name__ == "__main__":
    main()
