"""The synchronous engine loop: schedule, run the model, sample, emit outputs.

Everything here runs on the engine's one MLX thread.
"""

from __future__ import annotations

import itertools
import logging
import traceback
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from pippin import heap
from pippin.engine import prompt_logprobs
from pippin.engine.block_manager import BlockManager
from pippin.engine.cache_tiers import CacheTiers
from pippin.engine.config import MIN_BUFFER_CACHE, EngineConfig, SpeculativeConfig
from pippin.engine.draft_model import DraftModel
from pippin.engine.grammar_masks import GrammarMasks, split_constrained
from pippin.engine.mtp import MtpProposer
from pippin.engine.observer import EngineObserver
from pippin.engine.output_processor import OutputProcessor
from pippin.engine.sampler import SampleResult, sample
from pippin.engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from pippin.engine.sequence import Sequence, Think
from pippin.engine.speculative import Speculator
from pippin.engine.state_snapshots import StateSnapshots, snapshot_interval
from pippin.engine.types import (
    CompletionOutput,
    EngineError,
    RequestOutput,
    SamplingParams,
    TokenLogprob,
)
from pippin.runner.model_runner import ModelRunner
from pippin.runner.paged_cache import bytes_per_block
from pippin.store import lora as lora_files
from pippin.store.loaded import LoadedModel
from pippin.vision.encoder import VisionEncoder
from pippin.vision.inputs import SeqMedia

log = logging.getLogger(__name__)

DEFAULT_MAX_MODEL_LEN = 4096


# A sequence that was running in this many failed steps ends with the error.
STEP_ATTEMPTS = 3
# After the device ran out of memory, at most half the sequences that were running are
# admitted again, for this many steps; then `--max-num-seqs` holds again.
NARROW_STEPS = 256

OUT_OF_MEMORY_HINT = (
    " (the device ran out of memory: a smaller --max-num-seqs, --prefill-step-size, "
    "--cache-memory-percent or --buffer-cache-mb leaves more room)"
)


def out_of_memory(e: Exception) -> bool:
    text = str(e).lower()  # CUDA's words, then MLX's own allocator's
    return "out of memory" in text or "unable to allocate" in text


def step_error(e: Exception) -> str:
    """The error the requests of a failed step end with; running out of memory says
    what to change."""
    msg = f"engine error: {type(e).__name__}: {e}"
    return msg + OUT_OF_MEMORY_HINT if out_of_memory(e) else msg


@dataclass
class Request:
    request_id: str
    seqs: list[Sequence]
    prompt_tokens: int
    done: set[int] = field(default_factory=set)
    admitted: bool = False  # its admission output sent (`EngineCore._admitted`)


def check_prompt(prompt_ids: list[int], max_model_len: int) -> None:
    """Raise EngineError if the engine cannot take this prompt."""
    if not prompt_ids:
        raise EngineError("the prompt is empty")
    # The context is capped to the pool, so a prompt that fits it fits the pool.
    if len(prompt_ids) >= max_model_len:
        raise EngineError(
            f"the prompt has {len(prompt_ids)} tokens; the context is {max_model_len}"
        )


def _budget_near(s: Sequence) -> bool:
    tb = s.params.thinking
    assert tb is not None
    think = s.think
    if think.forced:
        return True
    if think.phase is Think.INSIDE:
        return think.count + len(s.pending) + 1 >= tb.budget
    return think.phase is Think.BEFORE and tb.budget <= 2


Sampled = tuple[list[ScheduledSeq], SampleResult]


def _arrays(result: SampleResult) -> list[mx.array]:
    return [
        a
        for a in (result.tokens, result.logprobs, result.top_ids, result.top_logprobs)
        if a is not None
    ]


class EngineCore:
    observer = EngineObserver()  # the engine loop sets its own

    def __init__(self, loaded: LoadedModel, config: EngineConfig) -> None:
        self.config = config
        self.loaded = loaded
        self.max_model_len = (
            config.max_model_len or loaded.max_position_embeddings or DEFAULT_MAX_MODEL_LEN
        )
        make_runner = config.make_runner or ModelRunner  # tensor parallel: its own
        self.runner = make_runner(
            loaded.model, config.block_size, config.kv_bits, config.kv_group_size, config.kernels
        )
        # Loaded before the pools are sized: its KV pool shares the KV budget.
        draft = self._load_draft(config.speculative)
        self.num_blocks = self._num_blocks(draft)
        self.runner.allocate(self.num_blocks)
        # A lone sequence must always fit the pool, or it could never be resumed.
        self.max_model_len = min(self.max_model_len, (self.num_blocks - 1) * config.block_size)
        if draft is not None:
            draft.allocate(min(self.num_blocks, self._draft_blocks()))
        # Both models' (the registry counts them against its memory limit).
        runners = [self.runner] + ([draft.runner] if draft is not None else [])
        pool = self.kv_bytes = sum(r.pool_bytes for r in runners)
        self.weight_bytes = sum(r.weight_bytes for r in runners)
        mx.set_cache_limit(config.buffer_cache_bytes or max(pool, MIN_BUFFER_CACHE))
        self.bm = BlockManager(self.num_blocks, config.block_size, config.enable_prefix_caching)
        # Recurrent state cannot be rebuilt from KV blocks: such models resume a cached
        # prefix from a snapshot of it.
        self.snapshots: StateSnapshots | None = None
        if self.runner.has_state_layers and config.enable_prefix_caching:
            interval = config.snapshot_interval_blocks
            if interval is None:
                per_token = bytes_per_block(self.runner.kv_specs, 1)
                interval = snapshot_interval(self.runner.state_bytes, per_token, config.block_size)
            self.snapshots = StateSnapshots(self.bm, self._snapshot_bytes(), interval)
            self.kv_bytes += self.snapshots.max_bytes
        self.tiers = CacheTiers.create(
            config, self.runner, self.bm, loaded, snapshots=self.snapshots
        )
        self.scheduler = Scheduler(
            self.bm,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            self.max_model_len,
            tiers=self.tiers,
            snapshots=self.snapshots,
            policy=config.scheduling_policy,
        )
        # The step launched last and not yet turned into outputs: its sequences, and
        # its sampled rows in groups (the unconstrained ones, then the constrained ones).
        self._inflight: tuple[list[ScheduledSeq], list[Sampled]] | None = None
        self._scores: list[mx.array] = []  # the last `_forward`'s prompt logprobs
        self.eos_ids = set(loaded.eos_token_ids)
        self.grammar = GrammarMasks(self.eos_ids)
        self.outputs = OutputProcessor(loaded.tokenizer, self.eos_ids, self.max_model_len)
        self.requests: dict[str, Request] = {}
        # A vision model's tower, run before each step's model call on the images it reaches.
        self.vision = VisionEncoder(loaded.vision) if loaded.vision is not None else None
        self._seq_ids = itertools.count()
        self.steps = 0
        graph, warm = self.runner.graph, config.kernels.warm_decode
        if graph is not None and warm > 0:
            shapes = graph.warm(config.max_num_seqs, min(warm, self.max_model_len))
            log.info("traced the decode step for %d shapes before serving", shapes)
        self._narrow_until: int | None = None  # see `recover`
        # Outputs of a step that raised after finishing the one in flight (see `step`).
        self._unsent: list[RequestOutput] = []
        self.failed_steps = {"out_of_memory": 0, "other": 0}
        # Sleep mode (`pippin.engine.sleep`): what sleeps, and the weights on the host.
        self.asleep: frozenset[str] = frozenset()
        self.host_weights: list[Any] | None = None
        self.spec: Speculator | None = None
        if config.speculative is not None:
            self.spec = Speculator(config.speculative, draft)

    def _load_draft(self, cfg: SpeculativeConfig | None) -> DraftModel | None:
        if cfg is not None and cfg.method == "mtp":
            return MtpProposer(
                cfg,
                self.loaded,
                self.runner,
                block_size=self.config.block_size,
                budget=self.config.max_num_batched_tokens,
            )
        if cfg is None or cfg.method != "draft_model":
            return None
        return DraftModel(
            cfg,
            self.loaded,
            block_size=self.config.block_size,
            budget=self.config.max_num_batched_tokens,
        )

    def _draft_blocks(self) -> int:
        """The draft blocks that speculating sequences at full context need: at most
        disable_by_batch_size of them speculate at once."""
        assert self.config.speculative is not None
        per_seq = self.max_model_len // self.config.block_size + 2
        return self.config.speculative.disable_by_batch_size * per_seq + 1

    def _snapshot_bytes(self) -> int:
        """What recurrent-state snapshots may hold: their share of the KV cache budget."""
        if not self.runner.has_state_layers or not self.config.enable_prefix_caching:
            return 0
        cfg = self.config
        budget = self.runner.cache_budget(cfg.cache_memory_bytes, cfg.cache_memory_percent)
        return int(budget * cfg.snapshot_memory_share)

    def _num_blocks(self, draft: DraftModel | None = None) -> int:
        cfg = self.config
        if cfg.num_blocks is not None:
            return max(cfg.num_blocks, 2)
        budget = self.runner.cache_budget(cfg.cache_memory_bytes, cfg.cache_memory_percent)
        # The runner owns the memory: it says how many blocks the budget holds.
        return self.runner.num_kv_blocks(
            max_num_seqs=cfg.max_num_seqs,
            max_model_len=self.max_model_len,
            budget_bytes=budget - self._snapshot_bytes(),
            memory_share=cfg.cache_memory_percent,
            draft_block_bytes=draft.bytes_per_block if draft is not None else 0,
            draft_blocks=self._draft_blocks() if draft is not None else 0,
        )

    # -- requests ---------------------------------------------------------
    def check(self, prompt_ids: list[int], params: SamplingParams) -> None:
        if self.asleep:
            raise EngineError("the engine is asleep")
        check_prompt(prompt_ids, self.max_model_len)
        if params.mm is not None:
            if self.vision is None:
                raise EngineError("this model does not take images")
            if any(im.end > len(prompt_ids) for im in params.mm.images):
                raise EngineError("an image's tokens lie outside the prompt")
        if params.prompt_logprobs is not None and self.config.tensor_parallel is not None:
            raise EngineError("prompt logprobs are not served with tensor parallelism")

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        self.check(prompt_ids, params)
        seqs = [
            Sequence(next(self._seq_ids), request_id, i, list(prompt_ids), params)
            for i in range(max(params.n, 1))
        ]
        if params.lora is not None:
            found = self.runner.lora.slot(params.lora) if self.runner.lora else None
            if found is None:
                raise EngineError(f"the LoRA adapter '{params.lora}' is not loaded")
            for s in seqs:
                s.lora, s.lora_key = found.slot, found.key
        if params.mm is not None:
            for s in seqs:
                s.media = SeqMedia.create(params.mm, s.prompt_ids)
        for s in seqs[1:]:
            s.wait_for = seqs[0]  # siblings reuse the first one's prompt blocks
        # Registered first: if adding sequence k fails, `abort` finds the ones before it
        # (holding KV blocks, or prefetching them from disk) and frees them.
        self.requests[request_id] = Request(request_id, seqs, len(prompt_ids))
        for s in seqs:
            self.outputs.init(s)
            self.scheduler.add(s)

    # -- LoRA adapters (between steps) -------------------------------------
    def add_lora(self, name: str, path: str) -> dict[str, Any]:
        """Serve the adapter at `path` as `name` (again: a no-op); EngineError if the
        model cannot take it."""
        if self.config.tensor_parallel is not None:
            raise EngineError("LoRA adapters are not served with tensor parallelism")
        if self.loaded.vision is not None:
            raise EngineError("LoRA adapters are not served on vision models")
        try:
            loaded = self.runner.add_lora(name, lora_files.read(path))
        except lora_files.LoraError as e:
            raise EngineError(f"the LoRA adapter '{name}': {e}") from None
        adapter = loaded.adapter
        return {"slot": loaded.slot, "rank": adapter.rank, "modules": len(adapter.modules)}

    def remove_lora(self, name: str) -> None:
        """Stop serving `name`; EngineError while a request runs with it."""
        lora = self.runner.lora
        if lora is None or lora.slot(name) is None:
            raise EngineError(f"the LoRA adapter '{name}' is not loaded")
        users = sum(1 for r in self.requests.values() if r.seqs[0].params.lora == name)
        if users:
            raise EngineError(f"the LoRA adapter '{name}' is in use by {users} request(s)")
        self.runner.remove_lora(name)

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        outs = []
        for s in req.seqs:
            if not s.finished:
                self.scheduler.finish(s)
                if self.spec is not None:
                    self.spec.forget(s)
                s.finish_reason = s.finish_reason or "abort"
                outs.append(CompletionOutput(s.index, [], "", None, s.finish_reason))
        return RequestOutput(request_id, outs, req.prompt_tokens, req.seqs[0].num_cached, True)

    def fail_all(self, message: str) -> list[RequestOutput]:
        self._inflight = None
        return [o for rid in list(self.requests) for o in self._fail(rid, message)]

    def recover(self, e: Exception) -> list[RequestOutput]:
        """Go on after `step` raised `e`, from what the host knows.

        The tokens of the steps in flight are dropped (no client saw them), and the KV
        pools are made anew: the failed step may have left them half written, or tied to
        a graph that would fail again when the next step evaluates it. So the prefix cache
        in memory is emptied too. If the device ran out of memory, every running sequence
        is preempted and recomputed from its known tokens, with at most half as many
        admitted for `NARROW_STEPS` steps; one in `STEP_ATTEMPTS` failed steps ends with
        the error. Any other error ends every request (it may come from any of them, and
        would come again)."""
        # The failed step's frames still hold its graph, and through it the old pools:
        # let them go before fresh ones are allocated, or both would be held at once.
        traceback.clear_frames(e.__traceback__)
        self._inflight = None
        sched = self.scheduler
        for seq in [*sched.running, *sched.waiting]:
            seq.pending.clear()
        message = step_error(e)
        outs, self._unsent = self._unsent, []
        oom = out_of_memory(e)
        self.failed_steps["out_of_memory" if oom else "other"] += 1
        if oom:
            running = sched.preempt_all()
            if running:
                sched.max_num_seqs = max(1, min(sched.max_num_seqs, len(running) // 2))
                self._narrow_until = self.steps + NARROW_STEPS
            failed = []
            for seq in running:
                seq.num_failed_steps += 1
                if seq.num_failed_steps >= STEP_ATTEMPTS:
                    failed.append(seq.request_id)
            ended = [o for rid in dict.fromkeys(failed) for o in self._fail(rid, message)]
            outs += ended
            log.warning(
                "the device ran out of memory: %d sequences to be recomputed, %d requests "
                "ended, at most %d running for %d steps",
                len(running),
                len(ended),
                sched.max_num_seqs,
                NARROW_STEPS,
            )
        else:
            outs += self.fail_all(message)
        self.runner.reset_pools(self.num_blocks)
        self.tiers.pools_reset()
        if self.spec is not None:
            self.spec.reset()
        return outs

    def _fail(self, request_id: str, message: str) -> list[RequestOutput]:
        out = self.abort(request_id)
        if out is None:
            return []
        for o in out.outputs:
            o.finish_reason = "error"
        out.error = message
        return [out]

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self._inflight is not None

    # -- one step ---------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Launch the next step, then turn the previous one into outputs.

        The host work of building step N+1 overlaps the device running step N: a
        decode's input is read lazily from the previous step's sampled tokens. Where
        sampling needs the previous token's value (penalties, speculation), the previous
        step is finished first; if this step then raises, its outputs are handed out by
        `recover` (their tokens are known, and a request may have ended in them).
        """
        outs: list[RequestOutput] = []
        try:
            return self._step(outs)
        except Exception:
            self._unsent = outs
            raise

    def _step(self, outs: list[RequestOutput]) -> list[RequestOutput]:
        if self._narrow_until is not None and self.steps >= self._narrow_until:
            self.scheduler.max_num_seqs = self.config.max_num_seqs
            self._narrow_until = None
        spec = self.spec
        if spec is not None and not spec.wanted(self.scheduler.running, self.steps + 1):
            spec = None
        if self._inflight is not None and (spec is not None or self._needs_sync()):
            outs.extend(self._finish_inflight())
        sched = self.scheduler.schedule()
        self.observer.scheduled(sched)
        if sched.empty:
            return outs + self._finish_inflight()
        self.steps += 1
        outs.extend(self._admitted(sched))
        # A step that scores prompt positions runs through `_forward`, never speculating.
        scoring = any(it.seq.scores_prompt for it in sched.prefills)
        if (
            spec is not None
            and not scoring
            and self._inflight is None
            and spec.propose(self, sched.decodes)
        ):
            return outs + spec.step(self, sched)
        everything, sampling, logits_parts = self._forward(sched)
        sampled: list[Sampled] = []
        to_eval: list = self.runner.arrays_to_eval(everything) + self._scores
        constrained: tuple[mx.array, list[ScheduledSeq]] | None = None
        if sampling:
            logits = logits_parts[0] if len(logits_parts) == 1 else mx.concatenate(logits_parts)
            # Constrained rows wait for their masks, which need the tokens still in flight.
            logits, sampling, constrained = split_constrained(logits, sampling)
        if sampling:
            result = sample(logits, [it.seq for it in sampling], self.eos_ids)
            to_eval.extend(_arrays(result))
            sampled.append((sampling, result))
        mx.async_eval(to_eval)
        for it in everything:
            it.seq.num_computed = it.start + it.length
        for items, result in sampled:
            for r, it in enumerate(items):
                it.seq.pending.append((result.tokens, r))
        outs += self._finish_inflight()
        if constrained is not None:
            # The device runs this step's model call meanwhile; the previous tokens are
            # known now, so the masks can be computed.
            c_logits, c_items = constrained
            seqs = [it.seq for it in c_items]
            allowed = self.grammar.allowed(seqs, c_logits.shape[-1])
            result = sample(c_logits, seqs, self.eos_ids, allowed)
            mx.async_eval(_arrays(result))
            for r, it in enumerate(c_items):
                it.seq.pending.append((result.tokens, r))
            sampled.append((c_items, result))
        self._inflight = (everything, sampled)
        return outs

    def _admitted(self, sched: SchedulerOutput) -> list[RequestOutput]:
        """Requests that asked (`SamplingParams.announce`), scheduled for the first time:
        each as an output without tokens that carries its prompt's cached tokens, known
        once the prefix is matched, before the prefill runs."""
        new = []
        for it in sched.prefills:
            if not it.seq.params.announce:
                continue
            req = self.requests.get(it.seq.request_id)
            if req is not None and not req.admitted:
                req.admitted = True
                cached = it.seq.num_cached
                new.append(RequestOutput(req.request_id, [], req.prompt_tokens, cached, False))
        return new

    def _forward(
        self, sched: SchedulerOutput
    ) -> tuple[list[ScheduledSeq], list[ScheduledSeq], list[mx.array]]:
        """Launch the step's model calls (decodes, then batches of prefill chunks): every
        row, the rows that sample, and their logits, one array per call. The prompt
        logprobs' arrays, to evaluate with the step, are left in `_scores`."""
        groups: list[list[ScheduledSeq]] = []
        if sched.decodes:
            groups.append(sched.decodes)
        groups.extend(self._group_prefills(sched.prefills))
        if self.vision is not None:
            self.vision.prepare(sched.prefills)  # the tower's step: images these chunks reach
        sampling: list[ScheduledSeq] = []
        logits_parts: list[mx.array] = []
        scores: list[mx.array] = []
        self._scores = scores
        for g, items in enumerate(groups):
            score = prompt_logprobs.positions(items)
            logits = self.runner.forward(items, score) if score else self.runner.forward(items)
            if score:
                assert self.runner.scored is not None
                scores += prompt_logprobs.record(items, score, self.runner.scored)
            if self.spec is not None:
                self.spec.saw(items, self.runner.hidden)
            if self.snapshots is not None:
                self.snapshots.after_forward(items)
            if logits is not None:
                logits_parts.append(logits)
                sampling.extend(it for it in items if it.samples)
            if g < len(groups) - 1:
                # The next call scatters into the same pools. Built into one graph with
                # this call's gathers, which still read them, MLX could not update the
                # pools in place and would copy every pool whole; launching this call
                # first keeps the writes in place (and overlaps building the next).
                mx.async_eval(logits_parts, scores, self.runner.arrays_to_eval(items))
        return [it for g in groups for it in g], sampling, logits_parts

    def _needs_sync(self) -> bool:
        # Penalties read the previous token's value, which the step in flight still holds;
        # so do bad words of several tokens, and a reasoning budget about to be spent (the
        # model may end it itself).
        return any(
            s.params.repetition_penalty != 1.0
            or s.params.presence_penalty
            or s.params.frequency_penalty
            or any(len(w) > 1 for w in s.params.bad_words_ids)
            or (s.params.thinking is not None and _budget_near(s))
            for s in self.scheduler.running
        )

    def _finish_inflight(self) -> list[RequestOutput]:
        if self._inflight is None:
            return []
        everything, sampled = self._inflight
        self._inflight = None
        for items, result in sampled:
            self._append_tokens(items, result)
        sampling = [it for items, _ in sampled for it in items]
        for it in everything:
            seq = it.seq
            if not seq.finished:
                # Only tokens known on the host can key a block.
                known = min(seq.num_computed, seq.num_known)
                self.bm.register_full_blocks(seq.table, seq.keys, known)
                if seq.boundaries and self.snapshots is not None:
                    self.snapshots.commit(seq)
        return self._collect(sampling)

    def _group_prefills(self, prefills: list[ScheduledSeq]) -> list[list[ScheduledSeq]]:
        if not prefills:
            return []
        return self.runner.call_groups(prefills)

    def _append_tokens(self, sampling: list[ScheduledSeq], result: SampleResult) -> None:
        tokens = result.tokens.tolist()
        lps = result.logprobs.tolist() if result.logprobs is not None else None
        top_ids = result.top_ids.tolist() if result.top_ids is not None else None
        top_lp = result.top_logprobs.tolist() if result.top_logprobs is not None else None
        for r, it in enumerate(sampling):
            seq = it.seq
            if seq.pending:
                seq.pending.pop(0)
            if seq.finished:
                continue  # ended (stop, abort) while this step was in flight
            lp = None
            if seq.params.logprobs and lps is not None:
                top: list[tuple[int, float]] = []
                k = seq.params.top_logprobs
                if k and top_ids is not None and top_lp is not None:
                    top = sorted(zip(top_ids[r], top_lp[r]), key=lambda x: -x[1])[:k]
                lp = TokenLogprob(tokens[r], lps[r], top)
            self.outputs.append(seq, tokens[r], lp)

    def _collect(self, sampling: list[ScheduledSeq]) -> list[RequestOutput]:
        by_req: dict[str, list[CompletionOutput]] = {}
        prompt_lps: dict[str, list[TokenLogprob | None]] = {}
        for it in sampling:
            seq = it.seq
            req = self.requests.get(seq.request_id)
            if req is None or seq.index in req.done:
                continue
            if seq.scores_prompt:
                prompt_lps[seq.request_id] = prompt_logprobs.take(seq)
            text = self.outputs.take_text(seq)
            token_ids, logprobs = seq.unsent.take()
            out = CompletionOutput(
                seq.index,
                token_ids,
                text,
                logprobs if seq.params.logprobs else None,
                seq.finish_reason,
                seq.stop_reason,
            )
            by_req.setdefault(seq.request_id, []).append(out)
            if seq.finish_reason is not None:
                self.scheduler.finish(seq)
                if self.spec is not None:
                    self.spec.forget(seq)
                req.done.add(seq.index)
        results = []
        for rid, outs in by_req.items():
            req = self.requests[rid]
            finished = len(req.done) == len(req.seqs)
            if finished:
                del self.requests[rid]
            out = RequestOutput(rid, outs, req.prompt_tokens, req.seqs[0].num_cached, finished)
            out.prompt_logprobs = prompt_lps.get(rid)
            results.append(out)
        return results

    def stats(self) -> dict[str, int]:
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "blocks_total": self.bm.num_usable,
            "blocks_free": self.bm.num_free,
            "block_size": self.bm.block_size,
            "prefix_queries": self.bm.queries,
            "prefix_hits": self.bm.hits,
            "preemptions": self.scheduler.num_preemptions,
            "steps": self.steps,
            "gc_frozen_objects": heap.frozen(),
            **self.runner.traces.stats(),
            "failed_steps_out_of_memory": self.failed_steps["out_of_memory"],
            "failed_steps_other": self.failed_steps["other"],
            # MLX's allocator (for the soak's memory slope, bench/soak.py).
            "mlx_active_bytes": mx.get_active_memory(),
            "mlx_cache_bytes": mx.get_cache_memory(),
            "weight_bytes": self.weight_bytes,
            "kv_bytes": self.kv_bytes,
            "sleeping": int(bool(self.asleep)),
            **(self.snapshots.stats() if self.snapshots is not None else {}),
            **(self.vision.stats() if self.vision is not None else {}),
            **(self.spec.stats() if self.spec is not None else {}),
        }
