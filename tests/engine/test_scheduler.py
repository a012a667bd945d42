"""`Scheduler` alone, over plain token lists: no model runs; a step's work is simulated
as the engine core records it (tokens computed, one sampled where a row samples)."""

from __future__ import annotations

import itertools

from pippin.engine.block_manager import BlockManager, salt_root
from pippin.engine.scheduler import Scheduler, SchedulerOutput
from pippin.engine.sequence import Sequence, Status
from pippin.engine.types import SamplingParams

BS = 4
_ids = itertools.count()


def _seq(n: int, max_tokens: int = 100, first: int = 0, **params: object) -> Sequence:
    prompt = list(range(first, first + n))
    return Sequence(next(_ids), "r", 0, prompt, SamplingParams(max_tokens=max_tokens, **params))


def _sched(
    num_blocks: int = 64, budget: int = 64, max_seqs: int = 8, max_len: int = 1000
) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, BS), max_seqs, budget, max_len)


def _run(s: Scheduler, out: SchedulerOutput, token: int = 7) -> None:
    """Record `out` as computed, as the core does after the model call."""
    for it in out.decodes + out.prefills:
        samples = it.samples
        it.seq.num_computed = it.start + it.length
        if samples:
            it.seq.output_ids.append(token)
        known = min(it.seq.num_computed, it.seq.num_known)
        s.bm.register_full_blocks(it.seq.table, it.seq.keys, known)


def _rows(items: list) -> list[tuple[Sequence, int, int]]:
    return [(it.seq, it.start, it.length) for it in items]


def test_a_prompt_is_prefilled_then_decoded_one_token_a_step() -> None:
    s = _sched()
    a = _seq(10)
    s.add(a)
    out = s.schedule()
    assert _rows(out.prefills) == [(a, 0, 10)] and out.decodes == []
    assert out.prefills[0].samples and a.status is Status.RUNNING
    _run(s, out)
    for step in range(3):
        out = s.schedule()
        assert _rows(out.decodes) == [(a, 10 + step, 1)] and out.prefills == []
        _run(s, out)
    assert len(a.output_ids) == 4


def test_decodes_run_before_prefills_and_share_the_budget() -> None:
    s = _sched(budget=8)
    a = _seq(4)
    s.add(a)
    _run(s, s.schedule())
    b = _seq(20, first=100)
    s.add(b)
    out = s.schedule()
    # a's decode first; b's prefill takes what is left of the 8 tokens.
    assert _rows(out.decodes) == [(a, 4, 1)]
    assert _rows(out.prefills) == [(b, 0, 7)]
    assert not out.prefills[0].samples  # a chunk short of the prompt's end samples nothing


def test_a_long_prompt_is_prefilled_in_chunks_under_the_budget() -> None:
    s = _sched(budget=8)
    a = _seq(20)
    s.add(a)
    chunks = []
    while not a.output_ids:
        out = s.schedule()
        chunks += [(it.start, it.length, it.samples) for it in out.prefills]
        _run(s, out)
    assert chunks == [(0, 8, False), (8, 8, False), (16, 4, True)]


def test_running_prefills_continue_before_new_ones_are_admitted() -> None:
    s = _sched(budget=10)
    a, b, c = _seq(6), _seq(6, first=50), _seq(12, first=90)
    for q in (a, b, c):
        s.add(q)
    out = s.schedule()
    assert _rows(out.prefills) == [(a, 0, 6), (b, 0, 4)]
    assert list(s.waiting) == [c]
    _run(s, out)
    out = s.schedule()
    # a decodes, b finishes its prompt, and c gets the rest of the budget.
    assert _rows(out.decodes) == [(a, 6, 1)]
    assert _rows(out.prefills) == [(b, 4, 2), (c, 0, 10 - 1 - 2)]


def test_admission_stops_at_max_num_seqs_in_arrival_order() -> None:
    s = _sched(max_seqs=2)
    seqs = [_seq(3, first=10 * i) for i in range(3)]
    for q in seqs:
        s.add(q)
    out = s.schedule()
    assert [it.seq for it in out.prefills] == seqs[:2]
    assert list(s.waiting) == seqs[2:]
    _run(s, out)
    assert s.schedule().prefills == []
    s.finish(seqs[0])
    out = s.schedule()
    assert [it.seq for it in out.decodes] == [seqs[1]]
    assert [it.seq for it in out.prefills] == seqs[2:]


def test_a_prompt_waits_for_blocks_and_keeps_its_place_in_line() -> None:
    s = _sched(num_blocks=6)  # 5 usable
    big, later = _seq(12, first=0), _seq(3, first=50)
    running = _seq(8, first=100)  # 2 blocks
    s.add(running)
    _run(s, s.schedule())
    s.add(big)  # needs 3 blocks: 2 are left once running's decode takes its third
    s.add(later)
    out = s.schedule()
    assert _rows(out.decodes) == [(running, 8, 1)]
    assert out.prefills == [] and list(s.waiting) == [big, later]
    # The small one behind it does not jump ahead, though it would fit.
    s.finish(running)
    out = s.schedule()
    assert [it.seq for it in out.prefills] == [big, later]


def test_the_newest_running_sequence_is_preempted_when_blocks_run_out() -> None:
    s = _sched(num_blocks=5)  # 4 usable
    old, new = _seq(8), _seq(8, first=50)  # 2 full blocks each
    s.add(old)
    s.add(new)
    _run(s, s.schedule())
    assert s.bm.num_free == 0
    new_blocks = list(new.table.block_ids)

    out = s.schedule()  # both need a third block for their 9th token
    assert out.preempted == [new]
    assert _rows(out.decodes) == [(old, 8, 1)]
    assert new.status is Status.WAITING and new.num_computed == 0
    assert new.table.block_ids == [] and new.num_preemptions == 1
    assert s.num_preemptions == 1 and list(s.waiting) == [new]
    assert set(old.table.block_ids) & set(new_blocks)  # its blocks went to `old`
    _run(s, out)

    # Resumed once there is room: recomputed from its known tokens (prompt and output).
    s.finish(old)
    out = s.schedule()
    assert _rows(out.prefills) == [(new, 4, 5)]  # its full first block is still cached
    assert new.status is Status.RUNNING and new.num_cached == 0
    assert out.prefills[0].samples
    _run(s, out, token=9)
    assert new.output_ids == [7, 9]


def test_a_sequence_that_needs_a_block_and_is_newest_preempts_itself() -> None:
    s = _sched(num_blocks=4)  # 3 usable
    old, new = _seq(3), _seq(8, first=50)
    s.add(old)
    s.add(new)
    _run(s, s.schedule())  # old: 1 block (room for one more token), new: 2 full ones
    out = s.schedule()
    assert out.preempted == [new]
    assert _rows(out.decodes) == [(old, 3, 1)]
    assert s.running == [old]


def test_preempt_all_resumes_oldest_first_ahead_of_waiting() -> None:
    s = _sched(max_seqs=2)
    a, b, c = _seq(3), _seq(3, first=10), _seq(3, first=20)
    for q in (a, b, c):
        s.add(q)
    _run(s, s.schedule())
    assert s.preempt_all() == [a, b]
    assert s.running == [] and list(s.waiting) == [a, b, c]
    assert all(q.num_computed == 0 and q.table.block_ids == [] for q in (a, b))
    assert s.bm.num_free == s.bm.num_usable
    assert [it.seq for it in s.schedule().prefills] == [a, b]


def test_finish_frees_the_blocks_of_running_and_waiting_sequences() -> None:
    s = _sched(budget=4)
    a, b = _seq(10), _seq(10, first=50)
    s.add(a)
    s.add(b)
    _run(s, s.schedule())  # a: first chunk of 4; b still waiting
    assert a.table.block_ids and list(s.waiting) == [b]
    a.recurrent = ["layer state"]
    s.finish(a)
    assert a.status is Status.FINISHED and a.table.block_ids == []
    assert a.recurrent is None and a not in s.running
    assert s.bm.num_free == s.bm.num_usable
    s.finish(b)
    assert b.status is Status.FINISHED and not s.has_work()
    assert s.schedule().empty


def test_a_sequence_whose_in_flight_tokens_end_it_is_not_scheduled() -> None:
    s = _sched()
    a = _seq(3, max_tokens=2)
    s.add(a)
    _run(s, s.schedule())
    out = s.schedule()
    assert _rows(out.decodes) == [(a, 3, 1)] and not a.exhausted(s.max_model_len)
    # The decode is launched; its token (the second and last) is still being sampled.
    a.num_computed = 4
    a.pending.append((None, 0))
    assert a.exhausted(s.max_model_len)
    assert s.schedule().empty


def test_a_sibling_waits_for_the_first_prefill_and_reuses_its_blocks() -> None:
    s = _sched(budget=8)
    params = SamplingParams(max_tokens=10)
    first = Sequence(next(_ids), "r", 0, list(range(10)), params)
    second = Sequence(next(_ids), "r", 1, list(range(10)), params, wait_for=first)
    s.add(first)
    s.add(second)
    out = s.schedule()
    assert _rows(out.prefills) == [(first, 0, 8)]
    _run(s, out)
    out = s.schedule()
    # Budget is left, but the first one's prompt is not all computed yet: wait.
    assert _rows(out.prefills) == [(first, 8, 2)]
    assert list(s.waiting) == [second]
    _run(s, out)
    out = s.schedule()
    assert _rows(out.decodes) == [(first, 10, 1)]
    assert _rows(out.prefills) == [(second, 8, 2)]
    assert second.num_cached == 8
    assert second.table.block_ids[:2] == first.table.block_ids[:2]


def test_add_keys_a_salted_sequence_apart() -> None:
    s = _sched()
    a = _seq(9)
    s.add(a)
    _run(s, s.schedule())
    # Same tokens, another salt: nothing shared.
    b = _seq(9, cache_salt="tenant")
    s.add(b)
    assert a.table.root is None and b.table.root == salt_root("tenant")
    _run(s, s.schedule())
    assert b.num_cached == 0
    assert not set(a.table.block_ids) & set(b.table.block_ids)
    # The same salt shares.
    c = _seq(9, cache_salt="tenant")
    s.add(c)
    s.schedule()
    assert c.num_cached == 8 and c.table.block_ids[:2] == b.table.block_ids[:2]
