"""Embedding and reranking models: loading, MLX forward passes and the batching worker."""
