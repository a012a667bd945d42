"""`--scheduling-policy priority`: the scheduler alone over plain token lists (as in
test_scheduler.py), then the engine on a tiny model, where a preempted request's tokens
must equal an uninterrupted run's."""

from __future__ import annotations

import itertools

import pytest
from support.engine_runs import engine_config, loaded_model, random_prompts, run_to_end

from pippin.engine.block_manager import BlockManager
from pippin.engine.core import EngineCore
from pippin.engine.scheduler import Scheduler, SchedulerOutput
from pippin.engine.sequence import Sequence, Status
from pippin.engine.types import SamplingParams

BS = 4
_ids = itertools.count()


def _seq(n: int, priority: int = 0, first: int = 0) -> Sequence:
    prompt = list(range(first, first + n))
    params = SamplingParams(max_tokens=100, priority=priority)
    return Sequence(next(_ids), f"r{priority}", 0, prompt, params)


def _sched(num_blocks: int = 64, max_seqs: int = 8, policy: str = "priority") -> Scheduler:
    return Scheduler(BlockManager(num_blocks, BS), max_seqs, 64, 1000, policy=policy)


def _run(s: Scheduler, out: SchedulerOutput) -> None:
    for it in out.decodes + out.prefills:
        samples = it.samples
        it.seq.num_computed = it.start + it.length
        if samples:
            it.seq.output_ids.append(7)
        known = min(it.seq.num_computed, it.seq.num_known)
        s.bm.register_full_blocks(it.seq.table, it.seq.keys, known)


def _running(s: Scheduler, *seqs: Sequence) -> None:
    """`seqs` admitted and their prompts computed."""
    for q in seqs:
        s.add(q)
    _run(s, s.schedule())


def test_the_waiting_queue_is_ordered_by_priority_then_arrival() -> None:
    s = _sched(max_seqs=1)
    a, b, c, d = _seq(3, 5), _seq(3, 0, 10), _seq(3, 5, 20), _seq(3, -1, 30)
    for q in (a, b, c, d):
        s.add(q)
    assert list(s.waiting) == [d, b, a, c]
    assert [it.seq for it in s.schedule().prefills] == [d]


def test_fcfs_keeps_arrival_order_whatever_the_priority() -> None:
    s = _sched(policy="fcfs")
    a, b = _seq(3, 5), _seq(3, 0, 10)
    s.add(a)
    s.add(b)
    assert list(s.waiting) == [a, b]


def test_an_urgent_request_takes_a_batch_slot_from_the_least_urgent() -> None:
    s = _sched(max_seqs=2)
    low, lower = _seq(3, 1), _seq(3, 2, 10)
    _running(s, low, lower)
    urgent = _seq(3, 0, 20)
    s.add(urgent)
    out = s.schedule()
    assert out.preempted == [lower]
    assert [it.seq for it in out.decodes] == [low]  # `lower`'s decode was taken back
    assert [it.seq for it in out.prefills] == [urgent]
    assert lower.status is Status.WAITING and lower.output_ids == [7]  # its tokens kept
    assert list(s.waiting) == [lower]


def test_an_urgent_request_takes_blocks_and_the_victim_resumes_from_its_cache() -> None:
    s = _sched(num_blocks=5)  # 4 usable
    low = _seq(8, 3)  # 2 full blocks, a third for its first output
    s.add(low)
    _run(s, s.schedule())
    _run(s, s.schedule())
    assert s.bm.num_free == 1
    urgent = _seq(8, 0, 50)  # needs 2 blocks
    s.add(urgent)
    out = s.schedule()
    assert out.preempted == [low] and out.decodes == []
    assert [it.seq for it in out.prefills] == [urgent]
    s.finish(urgent)
    # Resumed from its cached full blocks: only the rest is computed again.
    out = s.schedule()
    assert [(it.seq, it.start) for it in out.prefills] == [(low, 8)]


def test_equal_or_more_urgent_running_requests_are_never_preempted() -> None:
    s = _sched(max_seqs=2)
    a, b = _seq(3, 0), _seq(3, 1, 10)
    _running(s, a, b)
    late = _seq(3, 1, 20)  # b's priority: it waits
    s.add(late)
    out = s.schedule()
    assert out.preempted == [] and list(s.waiting) == [late]


def test_nothing_is_preempted_when_the_victims_would_not_free_enough() -> None:
    s = _sched(num_blocks=6)  # 5 usable
    high, low = _seq(12, 0), _seq(3, 5, 50)  # 3 blocks + 1 block
    _running(s, high, low)
    urgent = _seq(12, 1, 100)  # needs 3 blocks; `low` frees 1, with 1 free: 2
    s.add(urgent)
    out = s.schedule()
    assert out.preempted == [] and low.status is Status.RUNNING


def test_a_decode_out_of_blocks_preempts_the_least_urgent() -> None:
    s = _sched(num_blocks=5)  # 4 usable
    low, high = _seq(8, 9), _seq(8, 0, 50)  # low arrived first
    _running(s, low, high)
    out = s.schedule()  # both need a third block
    assert out.preempted == [low]  # fcfs would preempt the newest, `high`
    assert [it.seq for it in out.decodes] == [high]


# --- the engine --------------------------------------------------------------


def _params(seed: int | None, priority: int) -> SamplingParams:
    temperature = 0.0 if seed is None else 0.9
    return SamplingParams(
        max_tokens=24, temperature=temperature, seed=seed, ignore_eos=True, priority=priority
    )


@pytest.mark.parametrize("seed", [None, 11], ids=["greedy", "seeded"])
def test_an_urgent_request_preempts_and_the_victim_resumes_exactly(tiny_models, seed) -> None:
    loaded = loaded_model(tiny_models("llama"))
    low_prompt, urgent_prompt = random_prompts(loaded.model.args.vocab_size, 2, seed=4)
    low_prompt, urgent_prompt = (low_prompt * 3)[:40], (urgent_prompt * 3)[:40]

    # Uninterrupted: each alone.
    alone = EngineCore(loaded, engine_config(scheduling_policy="priority"))
    alone.add_request("low", low_prompt, _params(seed, 5))
    alone.add_request("urgent", urgent_prompt, _params(seed, 0))
    ref = run_to_end(alone)
    assert alone.stats()["preemptions"] == 0

    # 20 blocks of 4 tokens hold one of them (at most 64 tokens, 16 blocks), not both.
    core = EngineCore(
        loaded, engine_config(num_blocks=21, max_num_seqs=4, scheduling_policy="priority")
    )
    core.add_request("low", low_prompt, _params(seed, 5))
    order: list[str] = []
    res: dict[str, list[int]] = {"low": [], "urgent": []}

    def step() -> None:
        for out in core.step():
            for c in out.outputs:
                res[out.request_id] += c.token_ids
            if out.finished:
                order.append(out.request_id)

    while len(res["low"]) < 8:  # the low one is decoding
        step()
    core.add_request("urgent", urgent_prompt, _params(seed, 0))
    step()
    low_seq = core.requests["low"].seqs[0]
    assert low_seq.status is Status.WAITING and low_seq.num_preemptions == 1
    while core.has_work():
        step()
    assert order == ["urgent", "low"]  # the urgent one ran to its end first
    assert res["urgent"] == ref["urgent"]["ids"][0]
    assert res["low"] == ref["low"]["ids"][0]
    stats = core.stats()
    assert stats["preemptions"] == 1 and stats["blocks_free"] == stats["blocks_total"]
