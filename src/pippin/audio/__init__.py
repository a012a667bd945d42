"""Audio: text to speech (mlx-audio models), sentence splitting and encoding; decoding
uploads (PyAV) and speech to text (Whisper through mlx-audio)."""
