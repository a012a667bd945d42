"""Audio: text to speech (mlx-audio models), sentence splitting and encoding."""
