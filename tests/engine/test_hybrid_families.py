"""Every hybrid (attention + recurrent) and recurrent family mlx-lm 0.32 ships, through the
engine against mlx-lm's own generate_step: alone, batched with prompts of other lengths,
with prefill chunk boundaries inside the prompt, after preemption, and after prefix hits
(recurrent-state snapshots beside the KV blocks).

Models load through pippin's loader (as the engine takes them) and, for the references,
through `mlx_lm.utils.load` into a second copy the engine never patches.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import mlx.nn as nn
import pytest
from mlx_lm.models.cache import CacheList, make_prompt_cache
from mlx_lm.utils import load
from support import tiny_hybrids
from support.engine_runs import agrees, mlx_lm_reference, run_to_end

from pippin.engine.config import EngineConfig
from pippin.engine.core import EngineCore
from pippin.engine.types import SamplingParams
from pippin.store.loaded import LoadedModel
from pippin.store.loader import load_model

GEN = 16
# Four lengths: within one block, across a few, and past the 3-4 token convolution
# windows and a whole number of blocks.
LENGTHS = (7, 18, 33, 46)
GREEDY = SamplingParams(max_tokens=GEN, temperature=0.0, ignore_eos=True)


@dataclass
class Family:
    name: str
    loaded: LoadedModel  # what the engine runs (pippin's loader)
    reference: nn.Module  # mlx-lm's own load, never patched by the engine
    prompts: list[list[int]]
    refs: dict[tuple[int, ...], tuple[list[int], list[float]]] = field(default_factory=dict)

    def ref(self, prompt: list[int]) -> tuple[list[int], list[float]]:
        key = tuple(prompt)
        if key not in self.refs:
            self.refs[key] = mlx_lm_reference(self.reference, prompt, GEN)
        return self.refs[key]

    def check(self, got: list[int], prompt: list[int], what: str) -> None:
        ref, gaps = self.ref(prompt)
        assert agrees(got, ref, gaps), (self.name, what, got, ref)


# One load per family for the whole module; references are memoised per prompt.
_families: dict[str, Family] = {}


@pytest.fixture(params=tiny_hybrids.FAMILIES)
def hybrid(request: pytest.FixtureRequest, tiny_models: Any) -> Family:
    # `tiny_models` points the builds at the session's tiny-model folder.
    name = request.param
    if name not in _families:
        path = tiny_hybrids.get_tiny_hybrid(name)
        loaded = load_model(str(path))
        reference, _ = load(str(path))
        rng = random.Random(7)
        # Avoid the special ids 0-2 so no prompt holds an end-of-turn token.
        prompts = [[rng.randrange(3, loaded.vocab_size) for _ in range(n)] for n in LENGTHS]
        _families[name] = Family(name, loaded, reference, prompts)
    return _families[name]


def engine(family: Family, **kw: Any) -> EngineCore:
    base: dict[str, Any] = dict(
        num_blocks=400, block_size=4, max_model_len=512, max_num_batched_tokens=512
    )
    return EngineCore(family.loaded, EngineConfig(**(base | kw)))


def assert_all_freed(core: EngineCore) -> None:
    stats = core.stats()
    assert stats["running"] == stats["waiting"] == 0
    assert stats["blocks_free"] == stats["blocks_total"]


def test_both_layer_kinds(hybrid: Family) -> None:
    """Each hybrid's config yields attention and recurrent layers (Mamba: recurrent only),
    and the engine's runner takes both."""
    kinds: set[str] = set()
    for c in make_prompt_cache(hybrid.reference):
        for part in c.caches if isinstance(c, CacheList) else [c]:
            kinds.add(type(part).__name__)
    pure = hybrid.name in ("mamba", "mamba2")
    assert kinds == ({"ArraysCache"} if pure else {"ArraysCache", "KVCache"}), kinds
    runner = engine(hybrid).runner
    assert runner.has_state_layers and bool(runner.specs) != pure


def test_alone(hybrid: Family) -> None:
    core = engine(hybrid)
    for i, p in enumerate(hybrid.prompts):
        core.add_request(f"a{i}", p, GREEDY)
        hybrid.check(run_to_end(core)[f"a{i}"]["ids"][0], p, f"alone {len(p)}")
    assert_all_freed(core)


def test_batched_with_other_lengths(hybrid: Family) -> None:
    # All four start prefilling in one step (rows of different lengths share a padded
    # call where the recurrent layers mask padding, else one call per length), then
    # decode as one batch.
    core = engine(hybrid)
    for i, p in enumerate(hybrid.prompts):
        core.add_request(f"b{i}", p, GREEDY)
    res = run_to_end(core)
    for i, p in enumerate(hybrid.prompts):
        hybrid.check(res[f"b{i}"]["ids"][0], p, f"batched {len(p)}")
    assert_all_freed(core)


def test_prefill_chunk_boundaries(hybrid: Family) -> None:
    # Five tokens a step: the 46-token prompt takes ten steps, its chunks ending inside
    # blocks; the 18-token one starts in a step's leftover budget and shares later steps
    # with the first one's last chunk and decodes.
    core = engine(hybrid, max_num_batched_tokens=5)
    short, long_ = hybrid.prompts[1], hybrid.prompts[3]
    core.add_request("long", long_, GREEDY)
    core.add_request("short", short, GREEDY)
    res = run_to_end(core)
    hybrid.check(res["long"]["ids"][0], long_, "chunked 46")
    hybrid.check(res["short"]["ids"][0], short, "chunked 18")
    assert core.steps > len(long_) // 5
    assert_all_freed(core)


@pytest.mark.parametrize("caching", [True, False], ids=["snapshot", "recompute"])
def test_preemption(hybrid: Family, caching: bool) -> None:
    # 19 usable blocks of 4 tokens; the four sequences grow to 44 blocks. With the prefix
    # cache a preempted sequence resumes from its own snapshot where its blocks are still
    # cached; without, from its first token.
    core = engine(hybrid, num_blocks=20, max_num_batched_tokens=64, enable_prefix_caching=caching)
    for i, p in enumerate(hybrid.prompts):
        core.add_request(f"p{i}", p, GREEDY)
    res = run_to_end(core)
    assert core.stats()["preemptions"] > 0
    for i, p in enumerate(hybrid.prompts):
        hybrid.check(res[f"p{i}"]["ids"][0], p, f"preempted {len(p)}")
    assert_all_freed(core)


def test_prefix_hits(hybrid: Family) -> None:
    core = engine(hybrid)
    prompt = hybrid.prompts[3]
    core.add_request("first", prompt, GREEDY)
    first = run_to_end(core)["first"]
    assert first["cached"] == 0
    hybrid.check(first["ids"][0], prompt, "first")

    # The same prompt again: its blocks and the state after the last whole one.
    core.add_request("again", prompt, GREEDY)
    again = run_to_end(core)["again"]
    assert again["cached"] > 0, (hybrid.name, core.stats())
    hybrid.check(again["ids"][0], prompt, "same prompt, prefix hit")

    # An agent's next turn: the prompt, the answer, and a new message.
    turn = prompt + first["ids"][0] + [5, 6, 7, 8, 9]
    core.add_request("next", turn, GREEDY)
    nxt = run_to_end(core)["next"]
    # The finished answer left a snapshot too, so the hit reaches past the prompt.
    assert nxt["cached"] > len(prompt), (hybrid.name, nxt["cached"], core.stats())
    hybrid.check(nxt["ids"][0], turn, "next turn, prefix hit")

    assert core.stats().get("snapshot_hits", 0) >= 2, core.stats()
    assert_all_freed(core)
