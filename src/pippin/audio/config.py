"""`SttSettings`: the speech-to-text model and its limits, as `pippin serve` set them."""

from __future__ import annotations

from dataclasses import dataclass, field

MIB = 1024 * 1024


@dataclass
class SttSettings:
    # A Whisper folder (MLX or CTranslate2 layout); None: /v1/audio/transcriptions is off.
    model: str | None = None
    # Names accepted in the 'model' field; default: the folder's name and "whisper-1".
    names: list[str] = field(default_factory=list)
    # OpenAI's own cap on uploads is 25 MB.
    max_bytes: int = 25 * MIB
    # Longest audio accepted, in seconds.
    max_seconds: float = 3 * 3600.0

    @property
    def enabled(self) -> bool:
        return self.model is not None
