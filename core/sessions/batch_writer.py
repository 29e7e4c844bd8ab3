"""The store's batch writer: events arrive from any thread at high rates, so they are queued
and committed in batches on the writer's own connection (one transaction per batch).

A batch is committed at least every ``flush_interval_s`` or every ``max_batch`` rows; in WAL
mode with synchronous=NORMAL a committed batch survives a killed process, so a ``kill -9``
loses at most the last interval. A write error (disk full, file removed) is kept in
``error`` and reported by the store's ``flush``/``close``, never raised on the writer thread.
"""

from __future__ import annotations

import queue
import sqlite3
import threading
import time
from pathlib import Path

from core.sessions.schema import EVENT_COLS, LOG_COLS, OUTPUT_COLS, STREAM_EVENT_COLS, connect

INSERT_SQL = {
    "events": f"INSERT INTO events ({', '.join(EVENT_COLS)}) VALUES ({', '.join('?' * len(EVENT_COLS))})",
    "outputs": f"INSERT INTO outputs ({', '.join(OUTPUT_COLS)}) VALUES ({', '.join('?' * len(OUTPUT_COLS))})",
    "stream_events": f"INSERT INTO stream_events ({', '.join(STREAM_EVENT_COLS)}) "
                     f"VALUES ({', '.join('?' * len(STREAM_EVENT_COLS))})",
    "agent_logs": f"INSERT INTO agent_logs ({', '.join(LOG_COLS)}) VALUES ({', '.join('?' * len(LOG_COLS))})",
    "run_finished": "UPDATE runs SET status = ?, ended_at = ?, figures_json = ? WHERE id = ?",
}


STOP = object()


class BatchWriter(threading.Thread):
    """Commits queued rows in batches on its own connection (one transaction per batch)."""

    def __init__(self, path: Path, flush_interval_s: float, max_batch: int):
        super().__init__(name=f"store-writer:{path.name}", daemon=True)
        self.path, self.flush_interval_s, self.max_batch = path, flush_interval_s, max_batch
        self.queue: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        self.rows_written = 0

    def run(self) -> None:
        conn = connect(self.path)
        pending: list[tuple[str, tuple]] = []
        first_at = 0.0
        try:
            while True:
                timeout = None if not pending else max(0.0, self.flush_interval_s - (time.monotonic() - first_at))
                try:
                    item = self.queue.get(timeout=timeout)
                except queue.Empty:
                    self._flush(conn, pending)
                    continue
                if item is STOP or isinstance(item, threading.Event):
                    self._flush(conn, pending)
                    if item is STOP:
                        return
                    item.set()
                    continue
                if not pending:
                    first_at = time.monotonic()
                if isinstance(item, list):  # rows handed over together (SessionStore.batched)
                    pending.extend(item)
                else:
                    pending.append(item)
                if len(pending) >= self.max_batch:
                    self._flush(conn, pending)
        finally:
            conn.close()

    def _flush(self, conn: sqlite3.Connection, pending: list) -> None:
        if not pending or self.error is not None:
            pending.clear()
            return
        by_table: dict[str, list[tuple]] = {}
        for table, row in pending:
            by_table.setdefault(table, []).append(row)
        try:
            with conn:
                for table, rows in by_table.items():
                    conn.executemany(INSERT_SQL[table], rows)
            self.rows_written += len(pending)
        except sqlite3.Error as err:  # disk full, file removed: reported by flush()/close()
            self.error = err
        pending.clear()
