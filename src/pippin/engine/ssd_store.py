"""The SSD tier's store: one file per KV block, an SQLite index, a writer and a reader thread.

The store knows nothing of MLX or of the KV layout: a block is a key (its chained hash),
its token ids and a payload of raw bytes. Blocks of different models never mix: every
file and index row carries the fingerprint of the model, dtype and KV layout that wrote
it, and lookups only see rows of the current fingerprint.

- **Index**: SQLite (in the standard library; transactional, survives crashes, one file,
  cheap point lookups and an ordered scan for LRU eviction). Rows are (fingerprint, key,
  bytes, last use). The keys of the current fingerprint are mirrored in memory, so the
  engine thread checks membership without touching the database.
- **Files**: ``<dir>/<fingerprint>/<key[:2]>/<key>.kv``: a magic line, a JSON header
  (fingerprint, key, token ids, payload size), the payload, and a CRC-32 of header and
  payload. Written to a temporary name, flushed, fsync'd, then renamed (atomic). A file
  whose magic, header, size or checksum is wrong is counted as corrupt, deleted with its
  row, and yields nothing: never wrong KV.
- **Writer**: a bounded queue (``queue_blocks`` entries). When it is full, the block is
  not written and ``write_queue_full`` counts it. A failed write (disk full, I/O error)
  marks the tier degraded: serving goes on, writes are skipped (counted) and retried
  after ``RETRY_SECONDS``; a later successful write clears it.
- **Reader**: reads requested blocks in order and hands the results to the engine
  thread, which installs them into the memory pool ahead of scheduling.
- **Size cap**: after each write, least recently used rows (of any fingerprint) are
  deleted until the total is under ``max_bytes``.
- **One directory, several stores**: stores opened on one directory in this process (a
  hybrid model's KV blocks and its state snapshots, several models) share its index: one
  connection, one lock, one byte count for the cap, and a row one store deletes (size
  cap, clear) leaves the other's keys too.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import shutil
import sqlite3
import struct
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

MAGIC = b"PIPPINKV1\n"
RETRY_SECONDS = 30.0
INDEX_NAME = "index.sqlite3"


@dataclass
class ReadResult:
    key: int
    token_ids: tuple[int, ...]
    payload: bytes | None  # None: missing or corrupt


@dataclass
class _WriteJob:
    key: int
    token_ids: tuple[int, ...]
    parts: Sequence[np.ndarray]
    generation: int


def encode_block(
    fingerprint: str, key: int, token_ids: Sequence[int], parts: Sequence[Any]
) -> list[Any]:
    """The chunks of one block file, in order (parts are written without joining them)."""
    payload_size = sum(memoryview(p).nbytes for p in parts)
    header = json.dumps(
        {
            "fingerprint": fingerprint,
            "key": f"{key:032x}",
            "tokens": list(token_ids),
            "payload": payload_size,
        },
        separators=(",", ":"),
    ).encode()
    crc = zlib.crc32(header)
    for p in parts:
        crc = zlib.crc32(memoryview(p), crc)
    return [MAGIC, struct.pack("<I", len(header)), header, *parts, struct.pack("<I", crc)]


def decode_block(
    data: bytes, fingerprint: str, key: int, token_ids: Sequence[int], payload_size: int
) -> bytes | None:
    """The payload of a block file, or None if anything about it is wrong."""
    m = len(MAGIC)
    if len(data) < m + 8 or data[:m] != MAGIC:
        return None
    (hlen,) = struct.unpack_from("<I", data, m)
    start = m + 4 + hlen
    if start + payload_size + 4 != len(data):
        return None
    try:
        header = json.loads(data[m + 4 : start])
    except ValueError:
        return None
    if (
        header.get("fingerprint") != fingerprint
        or header.get("key") != f"{key:032x}"
        or header.get("tokens") != list(token_ids)
        or header.get("payload") != payload_size
    ):
        return None
    (crc,) = struct.unpack_from("<I", data, len(data) - 4)
    if zlib.crc32(memoryview(data)[m + 4 : len(data) - 4]) != crc:
        return None
    return data[start : start + payload_size]


class _Index:
    """The index of one directory, shared by every store open on it in this process."""

    def __init__(self, root: Path) -> None:
        self.lock = threading.Lock()
        self.db = sqlite3.connect(root / INDEX_NAME, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.execute(
            "CREATE TABLE IF NOT EXISTS blocks (fingerprint TEXT NOT NULL, key TEXT NOT NULL, "
            "size INTEGER NOT NULL, last_used REAL NOT NULL, PRIMARY KEY (fingerprint, key))"
        )
        self.db.execute("CREATE INDEX IF NOT EXISTS blocks_lru ON blocks (last_used)")
        self.db.commit()
        # Every file of every fingerprint, headers included.
        self.total_bytes = int(
            self.db.execute("SELECT COALESCE(SUM(size), 0) FROM blocks").fetchone()[0]
        )
        self.stores: list[SsdStore] = []


_indexes: dict[Path, _Index] = {}
_indexes_lock = threading.Lock()


class SsdStore:
    def __init__(
        self,
        root: str | os.PathLike[str],
        fingerprint: str,
        block_bytes: int,
        max_bytes: int,
        queue_blocks: int = 256,
        on_read: Callable[[], None] | None = None,
    ) -> None:
        self.root = Path(root)
        self.fingerprint = fingerprint
        self.block_bytes = block_bytes  # payload size of every block of this fingerprint
        self.max_bytes = max_bytes
        self.on_read = on_read
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / fingerprint).mkdir(exist_ok=True)
        with _indexes_lock:
            where = self.root.resolve()
            index = _indexes.get(where)
            if index is None:
                index = _indexes[where] = _Index(where)
            self._index = index
        self._lock = index.lock
        self._db = index.db
        with self._lock:
            index.stores.append(self)
            self.keys: set[int] = {
                int(k, 16)
                for (k,) in self._db.execute(
                    "SELECT key FROM blocks WHERE fingerprint = ?", (fingerprint,)
                )
            }
        for tmp in (self.root / fingerprint).glob("*/*.tmp"):  # left by a crash mid-write
            tmp.unlink(missing_ok=True)
        self.queued: set[int] = set()
        self._generation = 0
        self._writes: queue.Queue[_WriteJob | None] = queue.Queue(maxsize=max(queue_blocks, 1))
        self._reads: queue.Queue[list[tuple[int, tuple[int, ...]]] | None] = queue.Queue()
        self._results: list[ReadResult] = []
        self._closed = False
        # Counters (read by stats; written by one thread each).
        self.writes = 0
        self.write_errors = 0
        self.write_queue_full = 0
        self.skipped_degraded = 0
        self.reads = 0
        self.read_hits = 0
        self.corrupt = 0
        self.missing = 0
        self.evictions = 0
        self.degraded: str | None = None
        self._retry_at = 0.0
        self._writer = threading.Thread(
            target=self._write_loop, name="pippin-ssd-writer", daemon=True
        )
        self._reader = threading.Thread(
            target=self._read_loop, name="pippin-ssd-reader", daemon=True
        )
        self._writer.start()
        self._reader.start()

    @property
    def total_bytes(self) -> int:
        return self._index.total_bytes

    # -- paths ------------------------------------------------------------
    def _path(self, fingerprint: str, key_hex: str) -> Path:
        return self.root / fingerprint / key_hex[:2] / f"{key_hex}.kv"

    # -- engine-thread API -------------------------------------------------
    def contains(self, key: int) -> bool:
        return key in self.keys

    def known(self, key: int) -> bool:
        """On disk or on its way there."""
        return key in self.keys or key in self.queued

    def put(
        self, key: int, token_ids: tuple[int, ...], parts: Sequence[np.ndarray], block: bool = False
    ) -> bool:
        """Queue a block for writing; False (and counted) when it is not taken."""
        if self.known(key) or self._closed:
            return False
        if self.degraded is not None and time.monotonic() < self._retry_at:
            self.skipped_degraded += 1
            return False
        job = _WriteJob(key, token_ids, parts, self._generation)
        try:
            self._writes.put(job, block=block, timeout=60 if block else None)
        except queue.Full:
            self.write_queue_full += 1
            return False
        self.queued.add(key)
        return True

    def request(self, blocks: list[tuple[int, tuple[int, ...]]]) -> None:
        """Read these blocks in the background; results come back through `completed`."""
        if blocks:
            self._reads.put(blocks)

    def completed(self) -> list[ReadResult]:
        with self._lock:
            out, self._results = self._results, []
        return out

    def clear(self) -> int:
        """Delete every block of every fingerprint (those of the other stores on this
        directory too); returns how many there were."""
        stores = list(self._index.stores)
        for store in stores:
            store._drop_queued()
        with self._lock:
            n = int(self._db.execute("SELECT COUNT(*) FROM blocks").fetchone()[0])
            self._db.execute("DELETE FROM blocks")
            self._db.commit()
            for child in self.root.iterdir():
                if child.is_dir():
                    shutil.rmtree(child, ignore_errors=True)
            for store in stores:
                store._generation += 1
                store.keys.clear()
                (self.root / store.fingerprint).mkdir(exist_ok=True)
            self._index.total_bytes = 0
        return n

    def _drop_queued(self) -> None:
        """Take back the writes not started yet."""
        while True:
            try:
                job = self._writes.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                self.queued.discard(job.key)
            self._writes.task_done()

    def drain(self) -> None:
        """Wait until every queued write is done."""
        self._writes.join()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._writes.put(None)
        self._reads.put(None)
        self._writer.join(timeout=120)
        self._reader.join(timeout=10)
        with _indexes_lock, self._lock:
            self._index.stores.remove(self)
            if not self._index.stores:
                self._db.close()
                del _indexes[self.root.resolve()]

    def stats(self) -> dict[str, Any]:
        return {
            "blocks": len(self.keys),
            "bytes": len(self.keys) * self.block_bytes,  # KV of this model
            "disk_bytes": self.total_bytes,  # every file, of any model, headers included
            "max_bytes": self.max_bytes,
            "writes": self.writes,
            "write_errors": self.write_errors,
            "write_queue_depth": self._writes.qsize(),
            "write_queue_capacity": self._writes.maxsize,
            "write_queue_full": self.write_queue_full,
            "writes_skipped_degraded": self.skipped_degraded,
            "reads": self.reads,
            "read_hits": self.read_hits,
            "corrupt": self.corrupt,
            "missing": self.missing,
            "evictions": self.evictions,
            "degraded": self.degraded is not None,
            "degraded_reason": self.degraded,
        }

    # -- writer thread -----------------------------------------------------
    def _write_file(self, path: Path, chunks: list[Any]) -> None:
        """Write atomically: a temporary file, fsync'd, renamed over the final name."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + f".{threading.get_ident()}.tmp")
        try:
            with open(tmp, "wb") as f:
                for c in chunks:
                    f.write(c)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def _write_loop(self) -> None:
        while True:
            job = self._writes.get()
            try:
                if job is None:
                    return
                self._write_one(job)
            except Exception:  # a bug here must not stop the writer
                log.exception("SSD cache write failed")
            finally:
                if job is not None:
                    self.queued.discard(job.key)
                self._writes.task_done()

    def _write_one(self, job: _WriteJob) -> None:
        key_hex = f"{job.key:032x}"
        path = self._path(self.fingerprint, key_hex)
        parts = [np.ascontiguousarray(p) for p in job.parts]
        chunks = encode_block(self.fingerprint, job.key, job.token_ids, parts)
        size = sum(memoryview(c).nbytes for c in chunks)
        try:
            self._write_file(path, chunks)
        except OSError as e:
            self.write_errors += 1
            if self.degraded is None:
                log.warning(
                    "SSD cache degraded: writes fail (%s); serving goes on", e.strerror or e
                )
            self.degraded = f"write failed: {e.strerror or e}"
            self._retry_at = time.monotonic() + RETRY_SECONDS
            return
        with self._lock:
            if job.generation != self._generation:  # cleared while it was being written
                path.unlink(missing_ok=True)
                return
            self._db.execute(
                "INSERT OR REPLACE INTO blocks VALUES (?, ?, ?, ?)",
                (self.fingerprint, key_hex, size, time.time()),
            )
            self._db.commit()
            self.keys.add(job.key)
            self._index.total_bytes += size
            self.writes += 1
            if self.degraded is not None:
                log.info("SSD cache writes work again")
                self.degraded = None
            self._evict_over_cap()

    def _evict_over_cap(self) -> None:
        """Delete least recently used blocks until under the cap (lock held)."""
        while self._index.total_bytes > self.max_bytes:
            rows = self._db.execute(
                "SELECT fingerprint, key, size FROM blocks ORDER BY last_used LIMIT 64"
            ).fetchall()
            if not rows:
                self._index.total_bytes = 0
                return
            for fp, key_hex, size in rows:
                self._drop(fp, key_hex, size)
                self.evictions += 1
                if self._index.total_bytes <= self.max_bytes:
                    break
            self._db.commit()

    def _drop(self, fingerprint: str, key_hex: str, size: int | None = None) -> None:
        """Forget one block: file, row and in-memory key (lock held; caller commits)."""
        if size is None:
            row = self._db.execute(
                "SELECT size FROM blocks WHERE fingerprint = ? AND key = ?", (fingerprint, key_hex)
            ).fetchone()
            size = row[0] if row else 0
        self._db.execute(
            "DELETE FROM blocks WHERE fingerprint = ? AND key = ?", (fingerprint, key_hex)
        )
        self._path(fingerprint, key_hex).unlink(missing_ok=True)
        self._index.total_bytes -= size
        for store in self._index.stores:
            if store.fingerprint == fingerprint:
                store.keys.discard(int(key_hex, 16))

    # -- reader thread -----------------------------------------------------
    def _read_loop(self) -> None:
        while True:
            blocks = self._reads.get()
            if blocks is None:
                return
            results = []
            for key, tokens in blocks:
                try:
                    results.append(ReadResult(key, tokens, self._read_one(key, tokens)))
                except Exception:
                    log.exception("SSD cache read failed")
                    results.append(ReadResult(key, tokens, None))
            with self._lock:
                self._results.extend(results)
            if self.on_read is not None:
                self.on_read()

    def _read_one(self, key: int, tokens: tuple[int, ...]) -> bytes | None:
        key_hex = f"{key:032x}"
        path = self._path(self.fingerprint, key_hex)
        self.reads += 1
        try:
            data = path.read_bytes()
        except OSError:
            self.missing += 1
            with self._lock:
                self._drop(self.fingerprint, key_hex)
                self._db.commit()
            return None
        payload = decode_block(data, self.fingerprint, key, tokens, self.block_bytes)
        with self._lock:
            if payload is None:
                self.corrupt += 1
                log.warning("SSD cache: a corrupt block file was skipped and deleted")
                self._drop(self.fingerprint, key_hex)
            else:
                self.read_hits += 1
                self._db.execute(
                    "UPDATE blocks SET last_used = ? WHERE fingerprint = ? AND key = ?",
                    (time.time(), self.fingerprint, key_hex),
                )
            self._db.commit()
        return payload
