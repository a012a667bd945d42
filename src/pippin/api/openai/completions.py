"""POST /v1/completions: the legacy OpenAI completions API (text_completion objects).

A request may carry several prompts; each becomes one engine request with `n`
sequences, and choice `p * n + i` is sequence `i` of prompt `p`, as OpenAI orders them.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from pippin.api.common import (
    SSE_HEADERS,
    cancel_on_disconnect,
    get_state,
    obfuscation,
    parse_request,
    sse,
)
from pippin.api.openai.chat import usage_dict
from pippin.api.openai.protocol import CompletionRequest, framed_stream, sampling_of
from pippin.api.openai.structured_output import completion_constraint
from pippin.api.openapi import openai_route
from pippin.engine.client import EngineClient, EngineError
from pippin.engine.types import RequestOutput, SamplingParams, TokenLogprob
from pippin.serving.errors import bad_request, unsupported_param
from pippin.serving.limits import Limits, context_exceeded, truncate_prompt
from pippin.serving.logprobs import TokenRenderer, clamp_logprob, prompt_logprobs_body
from pippin.serving.pipeline import raise_failure
from pippin.serving.sampling import build_sampling_params, resolve_max_tokens
from pippin.serving.state import check_model, require_engine, use_model
from pippin.serving.streams import closing

router = APIRouter()
log = logging.getLogger(__name__)

# The API reference's default for this endpoint (chat has no such default).
DEFAULT_MAX_TOKENS = 16


@dataclass
class Prompt:
    ids: list[int]
    text: str  # for echo; decoded when the prompt came as token ids


def tokenize_prompts(
    tokenizer: Any, prompt: Any, add_special: bool, echo: bool = False
) -> list[Prompt]:
    """A request's prompts as token ids (also /tokenize's). Runs in a worker thread:
    tokenizing a long prompt can take a while."""
    if isinstance(prompt, str):
        items: list[str | list[int]] = [prompt]
    elif prompt and all(isinstance(x, int) for x in prompt):
        items = [prompt]
    else:
        items = list(prompt)
    out = []
    for item in items:
        if isinstance(item, str):
            ids = list(tokenizer.encode(item, add_special_tokens=add_special))
            if not ids:
                # As OpenAI: an empty prompt generates from the start of a new document.
                ids = _document_start(tokenizer)
            out.append(Prompt(ids, item))
        else:
            out.append(Prompt(list(item), tokenizer.decode(item) if echo else ""))
    return out


def _document_start(tokenizer: Any) -> list[int]:
    """The token a document starts after: BOS, or the end-of-text separator GPT-style
    vocabularies use between documents; none when the model has neither."""
    for tid in (getattr(tokenizer, "bos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(tid, int):
            return [tid]
    return []


def _check_prompts(prompts: list[Prompt], limits: Limits) -> None:
    if not prompts:
        raise bad_request("'prompt' must not be empty.", param="prompt")
    for p, pr in enumerate(prompts):
        if not pr.ids:
            raise bad_request(f"Prompt {p} is empty.", param="prompt")
        bad = next((t for t in pr.ids if not 0 <= t < limits.vocab_size), None)
        if bad is not None:
            raise bad_request(
                f"Invalid token id {bad} in prompt {p}: ids must be in [0, {limits.vocab_size}).",
                param="prompt",
            )


def _reject_unsupported(req: CompletionRequest) -> None:
    if req.suffix:
        raise unsupported_param("suffix", "Insertion (fill-in-the-middle) is not supported.")
    n = req.n or 1
    if req.best_of is not None and req.best_of != n:
        raise unsupported_param(
            "best_of", f"best_of must equal n ({n}); ranking candidates is not supported."
        )
    if req.echo and req.logprobs is not None and req.max_tokens == 0:
        # The prompt is scored by the engine, which a request for nothing never reaches.
        raise unsupported_param("echo", "echo with logprobs needs 'max_tokens' of at least 1.")
    if req.stream_options is not None and not req.stream:
        raise bad_request(
            "'stream_options' is only allowed when 'stream' is true.", param="stream_options"
        )
    if req.prompt_logprobs is not None and req.stream:
        # As vLLM: they come only in the whole response.
        raise bad_request(
            "'prompt_logprobs' is not available when 'stream' is true.", param="prompt_logprobs"
        )
    if req.prompt_logprobs is not None and req.max_tokens == 0:
        # The prompt is scored by the engine, which a request for nothing never reaches.
        raise bad_request(
            "'prompt_logprobs' needs 'max_tokens' of at least 1.", param="prompt_logprobs"
        )


def format_logprobs(
    lps: list[TokenLogprob], render: TokenRenderer, offset: int
) -> tuple[dict[str, Any], int]:
    """The legacy logprobs object for some tokens; returns it and the next text offset."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for lp in lps:
        text, _ = render(lp.token_id)
        top = {render(tid)[0]: clamp_logprob(v) for tid, v in lp.top}
        # As OpenAI: the sampled token is always among the alternatives (and wins
        # when another id renders to the same text, e.g. two partial characters).
        top[text] = clamp_logprob(lp.logprob)
        tokens.append(text)
        token_lps.append(clamp_logprob(lp.logprob))
        tops.append(top)
        offsets.append(offset)
        offset += len(text)
    body = {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops}
    body["text_offset"] = offsets
    return body, offset


def echo_logprobs(
    ids: list[int], lps: list[TokenLogprob | None], k: int, render: TokenRenderer
) -> tuple[dict[str, Any], int]:
    """The echoed prompt's legacy logprobs (echo with logprobs, as OpenAI and vLLM give
    them): its first token has none; the others `k` alternatives and their own."""
    text, _ = render(ids[0])
    body: dict[str, Any] = {
        "tokens": [text],
        "token_logprobs": [None],
        "top_logprobs": [None],
        "text_offset": [0],
    }
    rest = [TokenLogprob(lp.token_id, lp.logprob, lp.top[:k]) for lp in lps[1:] if lp]
    more, offset = format_logprobs(rest, render, len(text))
    for key, values in more.items():
        body[key].extend(values)
    return body, offset


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    tokens: int = 0
    offset: int = 0
    logprobs: dict[str, list[Any]] | None = None
    finish_reason: str | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass
class CompletionRun:
    engine: EngineClient
    prompts: list[Prompt]
    params: list[SamplingParams]
    request_id: str
    model: str
    fingerprint: str
    render: TokenRenderer
    echo: bool = False
    # The prompt logprobs asked for: vLLM's field (reported as `prompt_logprobs`) and,
    # with echo, the legacy `logprobs` alternatives of the echoed prompt.
    prompt_logprobs: int | None = None
    echo_logprobs: int | None = None
    include_usage: bool = False
    obfuscate: bool = False
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def n(self) -> int:
        return self.params[0].n

    def header(self) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.fingerprint,
        }

    async def _outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) from every prompt's engine request, as they come."""
        live = [p for p, sp in enumerate(self.params) if sp.max_tokens > 0]
        if len(live) == 1:
            p = live[0]
            gen = self.engine.generate(self.prompts[p].ids, self.params[p], self._rid(p))
            async with closing(gen) as outs:
                async for out in outs:
                    yield p, out
            return
        queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

        async def pump(p: int) -> None:
            try:
                gen = self.engine.generate(self.prompts[p].ids, self.params[p], self._rid(p))
                async with closing(gen) as outs:
                    async for out in outs:
                        await queue.put((p, out))
                await queue.put((p, None))
            except Exception as exc:  # handed to the consumer, which re-raises it
                await queue.put((p, exc))

        tasks = [asyncio.create_task(pump(p)) for p in live]
        try:
            left = len(tasks)
            while left:
                p, item = await queue.get()
                if item is None:
                    left -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield p, item
        finally:
            # Leaving early (client gone, error) closes every engine request.
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _rid(self, p: int) -> str:
        return self.request_id if len(self.prompts) == 1 else f"{self.request_id}-{p}"

    def _new_choices(self) -> list[_Choice]:
        choices = []
        for pr, sp in zip(self.prompts, self.params):
            for _ in range(self.n):
                ch = _Choice()
                if self.echo:
                    ch.text.append(pr.text)
                    ch.offset = len(pr.text)
                if sp.logprobs:
                    ch.logprobs = {"tokens": [], "token_logprobs": [], "top_logprobs": []}
                    ch.logprobs["text_offset"] = []
                if sp.max_tokens == 0:
                    ch.finish_reason = "length"
                choices.append(ch)
        return choices

    async def collect(self) -> dict[str, Any]:
        choices = self._new_choices()
        usage = {p: (len(pr.ids), 0) for p, pr in enumerate(self.prompts)}
        async for p, out in self._outputs():
            usage[p] = (out.prompt_tokens, out.cached_tokens)
            raise_failure(out)
            if out.prompt_logprobs is not None:
                for i in range(self.n):  # every choice of this prompt
                    ch = choices[p * self.n + i]
                    ch.prompt_logprobs = out.prompt_logprobs
                    echoed = self._echoed(p, out.prompt_logprobs)
                    if echoed is not None and ch.logprobs is not None:
                        body, ch.offset = echoed
                        ch.logprobs = {key: v + ch.logprobs[key] for key, v in body.items()}
            for c in out.outputs:
                ch = choices[p * self.n + c.index]
                ch.text.append(c.text)
                ch.tokens += len(c.token_ids)
                if c.logprobs and ch.logprobs is not None:
                    lp, ch.offset = format_logprobs(c.logprobs, self.render, ch.offset)
                    for k, v in lp.items():
                        ch.logprobs[k].extend(v)
                if c.finish_reason is not None:
                    ch.finish_reason = c.finish_reason
        body = self.header()
        body["choices"] = [
            {
                "index": i,
                "text": "".join(ch.text),
                "logprobs": ch.logprobs,
                "finish_reason": ch.finish_reason or "stop",
            }
            for i, ch in enumerate(choices)
        ]
        if self.prompt_logprobs is not None:
            for body_choice, ch in zip(body["choices"], choices):
                lps = ch.prompt_logprobs or []
                body_choice["prompt_logprobs"] = prompt_logprobs_body(lps, self.render)
        prompt_tokens = sum(u[0] for u in usage.values())
        cached = sum(u[1] for u in usage.values())
        body["usage"] = usage_dict(prompt_tokens, sum(c.tokens for c in choices), cached)
        return body

    def _echoed(self, p: int, lps: list[TokenLogprob | None]) -> tuple[dict[str, Any], int] | None:
        """Prompt `p`'s echoed logprobs and the text offset after them, if asked for."""
        if self.echo_logprobs is None:
            return None
        return echo_logprobs(self.prompts[p].ids, lps, self.echo_logprobs, self.render)

    def _chunk(self, choices: list[dict[str, Any]]) -> str:
        body = self.header()
        body["choices"] = choices
        if self.include_usage:
            body["usage"] = None
        if self.obfuscate:
            body["obfuscation"] = obfuscation()
        return sse(body)

    def stream(self) -> AsyncIterator[str]:
        usage = {p: (len(pr.ids), 0) for p, pr in enumerate(self.prompts)}
        tally = {"completion": 0}

        def usage_chunk() -> dict[str, Any] | None:
            if not self.include_usage:
                return None
            body = self.header()
            body["choices"] = []
            prompt_tokens = sum(u[0] for u in usage.values())
            cached = sum(u[1] for u in usage.values())
            body["usage"] = usage_dict(prompt_tokens, tally["completion"], cached)
            return body

        return framed_stream(self._events(usage, tally), usage_chunk)

    async def _events(
        self, usage: dict[int, tuple[int, int]], tally: dict[str, int]
    ) -> AsyncIterator[str]:
        choices = self._new_choices()
        first = []
        for i, ch in enumerate(choices):
            if ch.text or ch.finish_reason:  # the echoed prompt; max_tokens=0 ends here
                text = "".join(ch.text)
                first.append(
                    {"index": i, "text": text, "logprobs": None, "finish_reason": ch.finish_reason}
                )
        if first:
            yield self._chunk(first)
        async with closing(self._outputs()) as outputs:
            async for p, out in outputs:
                usage[p] = (out.prompt_tokens, out.cached_tokens)
                raise_failure(out)
                echoed = self._echoed(p, out.prompt_logprobs) if out.prompt_logprobs else None
                if echoed is not None:
                    # The echoed prompt's logprobs, in a chunk of their own before the
                    # first generated text.
                    batch = []
                    for i in range(p * self.n, (p + 1) * self.n):
                        body, choices[i].offset = echoed
                        batch.append(
                            {"index": i, "text": "", "logprobs": body, "finish_reason": None}
                        )
                    yield self._chunk(batch)
                batch = []
                for c in out.outputs:
                    tally["completion"] += len(c.token_ids)
                    i = p * self.n + c.index
                    lp = None
                    if c.logprobs and choices[i].logprobs is not None:
                        lp, choices[i].offset = format_logprobs(
                            c.logprobs, self.render, choices[i].offset
                        )
                    if not c.text and lp is None and c.finish_reason is None:
                        continue
                    batch.append(
                        {
                            "index": i,
                            "text": c.text,
                            "logprobs": lp,
                            "finish_reason": c.finish_reason,
                        }
                    )
                if batch:
                    yield self._chunk(batch)


@router.post("/v1/completions", response_model=None, **openai_route(CompletionRequest, stream=True))
async def create_completion(request: Request) -> Any:
    req = await parse_request(CompletionRequest, await request.body())
    server = get_state(request)
    check_model(server, req.model)
    _reject_unsupported(req)
    live = await use_model(server, req.model)
    engine, loaded = require_engine(live)
    limits = live.limits
    assert limits is not None

    add_special = True if req.add_special_tokens is None else req.add_special_tokens
    prompts = await asyncio.to_thread(
        tokenize_prompts, loaded.tokenizer, req.prompt, add_special, bool(req.echo)
    )
    _check_prompts(prompts, limits)
    for pr in prompts:
        pr.ids = truncate_prompt(pr.ids, req.truncate_prompt_tokens, limits)
    constraint = await completion_constraint(live, req)
    echo_k = req.logprobs if req.echo else None
    params: list[SamplingParams] = []
    for pr in prompts:
        if req.max_tokens == 0:
            # Nothing to generate (useful with echo); the engine is not involved.
            if len(pr.ids) > limits.max_model_len:
                raise context_exceeded(limits.max_model_len, len(pr.ids), "prompt")
            max_tokens = 0
        else:
            max_tokens = resolve_max_tokens(
                req.max_tokens,
                len(pr.ids),
                limits,
                live.defaults.get("max_tokens"),
                DEFAULT_MAX_TOKENS,
                "prompt",
            )
        sp = build_sampling_params(
            sampling_of(req, req.logprobs is not None, req.logprobs or 0),
            max_tokens=max(max_tokens, 1),
            limits=limits,
            defaults=live.defaults,
            tokenizer=loaded.tokenizer,
        )
        sp.max_tokens = max_tokens
        sp.constraint = constraint
        if echo_k is not None:
            sp.prompt_logprobs = max(echo_k, sp.prompt_logprobs or 0)
        if max_tokens:
            try:
                engine.check(pr.ids, sp)
            except EngineError as exc:
                raise bad_request(str(exc), param="prompt") from None
        params.append(sp)

    run = CompletionRun(
        engine=engine,
        prompts=prompts,
        params=params,
        request_id=f"cmpl-{uuid.uuid4().hex}",
        model=req.model,
        fingerprint=live.fingerprint,
        render=live.token_renderer,
        echo=bool(req.echo),
        prompt_logprobs=req.prompt_logprobs,
        echo_logprobs=echo_k,
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        obfuscate=bool(req.stream_options and req.stream_options.include_obfuscation),
    )
    if req.stream:
        return StreamingResponse(run.stream(), media_type="text/event-stream", headers=SSE_HEADERS)
    # JSONResponse directly: FastAPI's generic encoder is slow on big logprobs bodies.
    return JSONResponse(await cancel_on_disconnect(request.receive, run.collect()))
