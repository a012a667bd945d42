"""Observability: Prometheus metrics, the per-request log line, and the engine's hooks."""
