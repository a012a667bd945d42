"""pippin: an inference server for large language models on MLX."""

from pippin import mlx_env

__version__ = "0.1.0"

mlx_env.apply()
