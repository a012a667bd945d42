"""The sessions a workload makes, from its prompt source: words and editing tasks
(`pippin.bench.workload`) or a tool-using agent's (`pippin.bench.agent`)."""

from __future__ import annotations

import math

from pippin.bench.agent import agent_sessions
from pippin.bench.workload import Session, Workload, word_sessions


def make_sessions(w: Workload, num_requests: int, seed: int | str) -> list[Session]:
    """Enough sessions for `num_requests` requests; the same seed gives the same prompts."""
    if w.prompt_source == "agent":
        return agent_sessions(w, math.ceil(num_requests / w.turns), seed)
    return word_sessions(w, num_requests, seed)
