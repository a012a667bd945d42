"""The Python heap of a long-running process: what the garbage collector scans.

A loaded engine holds some 300,000 Python objects that live as long as the process (the
model's modules, the tokenizer, every imported module). CPython's full collection scans
all of them, and it runs whenever enough new objects have survived since the last one: on
a 2-core CPU each took about 150 ms with SmolLM2 loaded, a stall of every stream the
engine's loop or the API's event loop was serving. Frozen once startup is done
(`freeze`), they leave the collector's scans, as vLLM does with its engine (a full
collection then took under 1 ms).

Frozen objects are still freed when nothing refers to them, but a reference cycle among
them is not, until `collect`: what gives back an unloaded model's memory, a sleeping one's
or a replaced KV pool's thaws the heap first.
"""

from __future__ import annotations

import gc

from pippin import envs

# The permanent generation's size as of the last `freeze` or `collect`: CPython counts it
# by walking the list (20 ms over 300,000 objects on a 2-core CPU), and engine stats,
# which an engine process sends with every step's outputs, report it.
_frozen = 0


def freeze() -> int:
    """Collect startup's garbage, then move every object still alive into the permanent
    generation, which no collection scans (unless `PIPPIN_FREEZE_HEAP=0`); how many
    objects it now holds."""
    global _frozen
    if envs.PIPPIN_FREEZE_HEAP:
        gc.collect()
        gc.freeze()
    _frozen = gc.get_freeze_count()
    return _frozen


def frozen() -> int:
    """How many objects the permanent generation held at the last `freeze` or `collect`
    (the objects frozen since freed are not subtracted)."""
    return _frozen


def collect() -> None:
    """A full collection that reaches frozen objects too (the cycles of an unloaded model,
    a replaced pool): the heap thawed, collected, and what is left frozen again."""
    global _frozen
    was_frozen = gc.get_freeze_count() > 0
    gc.unfreeze()
    gc.collect()
    if was_frozen:
        gc.freeze()
        _frozen = gc.get_freeze_count()
