"""`--scheduling-policy priority` over HTTP with the openai SDK: an urgent request takes
the only batch slot from a running one, which resumes and ends as it would have alone."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from support.server_utils import run_server

MESSAGES = [{"role": "user", "content": "Write a long story about the sea."}]
LONG = 1500


def test_an_urgent_request_preempts_a_running_one(tiny_models: Callable[..., Path]) -> None:
    with run_server(
        str(tiny_models("llama")),
        "--served-model-name",
        "tiny",
        "--scheduling-policy",
        "priority",
        "--max-num-seqs",
        "1",
        "--max-model-len",
        "2048",
    ) as server:
        client = server.client()

        def ask(priority: int, n: int, stream: bool = False):  # type: ignore[no-untyped-def]
            return client.chat.completions.create(
                model="tiny",
                messages=MESSAGES,  # type: ignore[arg-type]
                max_tokens=n,
                temperature=0,
                stream=stream,
                extra_body={"priority": priority, "ignore_eos": True},
            )

        low_text: list[str] = []
        urgent_done = threading.Event()
        low_unfinished_then: list[bool] = []
        stream = ask(10, LONG, stream=True)
        chunks = iter(stream)
        # The role chunk is sent before the engine admits the request; the first chunk after
        # it carries a generated token, so only then is the low one surely running.
        for _ in range(2):
            first = next(chunks)
            low_text.append(first.choices[0].delta.content or "" if first.choices else "")

        def urgent() -> None:
            r = ask(0, 8)
            assert r.usage is not None and r.usage.completion_tokens == 8
            urgent_done.set()

        t = threading.Thread(target=urgent)
        t.start()
        finish = None
        for chunk in chunks:
            if chunk.choices:
                low_text.append(chunk.choices[0].delta.content or "")
                if chunk.choices[0].finish_reason is not None:
                    # Where the low one ended, the urgent one had already been answered.
                    low_unfinished_then.append(urgent_done.is_set())
                    finish = chunk.choices[0].finish_reason
        t.join()
        assert finish == "length" and low_unfinished_then == [True]
        with server.http() as h:
            assert h.get("/v1/engine/stats").json()["preemptions"] >= 1
        # Resumed exactly: the same text as the same request alone.
        alone = ask(10, LONG)
        assert "".join(low_text) == alone.choices[0].message.content
