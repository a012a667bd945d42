"""Sleep mode on the engine (`pippin.engine.sleep`): the KV pool let go and made anew,
the weights to the host and back, requests refused meanwhile, the same greedy output
after waking."""

from __future__ import annotations

import mlx.core as mx
import pytest
from support.engine_runs import engine_config, loaded_model, random_prompts, run_to_end

from pippin.engine import sleep
from pippin.engine.core import EngineCore
from pippin.engine.types import EngineError, SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
BOTH = frozenset({"weights", "kv_cache"})


def _answer(core: EngineCore, prompt: list[int], rid: str) -> list[int]:
    core.add_request(rid, prompt, GREEDY)
    return run_to_end(core)[rid]["ids"][0]


@pytest.mark.parametrize("offload", [False, True], ids=["weights-kept", "weights-to-host"])
def test_sleep_frees_the_pool_and_waking_answers_the_same(tiny_models, offload: bool) -> None:
    loaded = loaded_model(tiny_models("qwen3"))
    core = EngineCore(loaded, engine_config())
    prompt = random_prompts(loaded.model.args.vocab_size, 1, seed=2)[0]
    before = _answer(core, prompt, "a")
    assert core.bm.num_cached > 0
    awake = core.stats()
    assert awake["kv_bytes"] > 0 and awake["sleeping"] == 0

    stats, outs = sleep.put_to_sleep(core, BOTH, abort=False, offload=offload)
    assert outs == [] and stats["sleeping"] == 1 and stats["kv_bytes"] == 0
    assert core.bm.num_cached == 0  # the prefix cache went with the pool
    freed = awake["kv_bytes"] + (awake["weight_bytes"] if offload else 0)
    # All of it, but for the empty arrays in the weights' place.
    assert stats["mlx_active_bytes"] <= awake["mlx_active_bytes"] - freed + 1024
    with pytest.raises(EngineError, match="asleep"):
        core.add_request("b", prompt, GREEDY)

    # Weights alone: still asleep.
    assert sleep.wake(core, frozenset({"weights"}))["sleeping"] == 1
    stats = sleep.wake(core, frozenset({"kv_cache"}))
    assert stats["sleeping"] == 0 and stats["kv_bytes"] == awake["kv_bytes"]
    assert _answer(core, prompt, "c") == before
    assert core.stats()["prefix_hits"] == 0  # recomputed, nothing cached survived


def test_sleep_aborts_running_requests_or_refuses(tiny_models) -> None:
    loaded = loaded_model(tiny_models("llama"))
    core = EngineCore(loaded, engine_config())
    prompt = random_prompts(loaded.model.args.vocab_size, 1, seed=3)[0]
    core.add_request("r", prompt, GREEDY)
    core.step()
    with pytest.raises(EngineError, match="running"):
        sleep.put_to_sleep(core, BOTH, abort=False)
    assert core.has_work() and not core.asleep
    _, outs = sleep.put_to_sleep(core, BOTH, abort=True)
    assert [o.request_id for o in outs] == ["r"] and outs[0].error == sleep.ASLEEP
    assert not core.has_work() and core.stats()["blocks_free"] == core.stats()["blocks_total"]
    sleep.wake(core, BOTH)
    assert len(_answer(core, prompt, "again")) == 12
    mx.clear_cache()
