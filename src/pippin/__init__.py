"""pippin: an inference server for large language models on MLX."""

__version__ = "0.1.0"
