"""The registry serving the library's models (`ModelRegistry` over `ModelLibrary`): a
model published to the folder resolves by name (tag optional) with its settings, and a
deleted one stops resolving at once while its files stay until its last lease ends. A
real tiny model on a real engine, in process."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from pippin.engine.config import EngineConfig
from pippin.serving.errors import ApiError
from pippin.serving.model_specs import ModelSpec
from pippin.serving.registry import ModelRegistry
from pippin.serving.settings import ServerSettings
from pippin.store.library import ModelLibrary, StoredModel
from pippin.store.model_files import gather, source_files


def publish(library: ModelLibrary, name: str, source: Path, **settings: object) -> StoredModel:
    folder = library.partial(name)
    files = gather(folder, source_files(source), {})
    model = StoredModel(name, "", str(source), files, settings=dict(settings))
    return library.publish(model, folder)


def test_library_models_are_served_and_deleted_after_their_last_lease(
    tiny_models: Callable[..., Path], tmp_path: Path
) -> None:
    library = ModelLibrary(tmp_path / "lib")
    source = tmp_path / "src"
    shutil.copytree(tiny_models("llama", seed=4), source)

    async def main() -> None:
        settings = ServerSettings(
            engine=EngineConfig(num_blocks=64, max_model_len=256),
            models_dirs=[str(library.root)],
        )
        reg = ModelRegistry(settings, [ModelSpec(str(tiny_models("llama", seed=1)), names=["m"])])
        await reg.start()
        try:
            stored = publish(
                library, "pirate", source, system="Arr.", parameters={"temperature": 0.1}
            )
            entry = reg.resolve("pirate")  # published after the start: found by name
            assert reg.resolve("pirate:latest") is entry and entry.stored is not None
            assert [e.name for e in reg.entries()] == ["m", "pirate:latest"]
            assert entry.spec.system == "Arr." and entry.spec.sampling == {"temperature": 0.1}
            async with reg.lease("pirate") as live:
                assert live.system == "Arr." and live.defaults["temperature"] == 0.1
                assert live.with_preset([{"role": "user", "content": "hi"}])[0] == {
                    "role": "system",
                    "content": "Arr.",
                }
                await reg.delete_stored(entry)
                with pytest.raises(ApiError) as info:
                    reg.resolve("pirate")  # gone for new requests at once
                assert info.value.status == 404
                assert "pirate:latest" not in [e.name for e in reg.entries()]
                assert stored.folder.is_dir() and entry.state == "loaded"  # still in use
            # The lease ended: the reaper unloads it and deletes its files.
            for _ in range(600):
                if not stored.folder.exists():
                    break
                await asyncio.sleep(0.05)
            assert not stored.folder.exists() and library.get("pirate") is None
            assert entry.state == "unloaded"
        finally:
            await reg.stop()

    asyncio.run(main())
