"""A block store in a local directory: one file per block, LRU under a byte capacity.

Layout on disk::

    <root>/<namespace.name>/.lock          held (flock) while a store object has it open
    <root>/<namespace.name>/<xx>/<key>      one blob per block (see ``base`` for the format)
    <root>/<namespace.name>/<xx>/.tmp-...   a write in progress (never read; removed at open)
    <root>/<namespace.name>/links           "<key> <parent key>" lines (``put_links``)

``<key>`` is the encoded key (``i-42``, ``h3fa9...``; a digest when very long)
and ``<xx>`` the first two hex digits of its xxh3_64, so no directory grows past
a few thousand entries at millions of blocks.

Why it is safe:

* **atomic writes** — a blob is written to a temporary file in the same
  directory and moved into place with ``os.replace``; a reader sees the old
  blob, the new one or none, never half of one. A failed write (ENOSPC,
  EDQUOT, any ``OSError``) removes its temporary file and ``put`` answers
  ``False``. ``fsync=True`` adds fsyncs of the file and its directory, for
  blocks that must survive a power cut (the default trusts the page cache:
  a lost block is only a recompute).
* **checksummed reads** — every read verifies the header and the xxh3_64
  checksum; a bad blob is deleted, counted as ``corrupt`` and reported as a miss.
* **LRU by capacity** — an in-memory ``OrderedDict`` of file -> size is touched
  on every hit and put; a put evicts least recently used blobs until it fits.
  Capacity counts blob bytes (header + payload), not filesystem blocks. A put
  replaces: the key's old blob is dropped first (so a failed put leaves the
  key absent, never stale), and a blob larger than the whole capacity is
  refused without evicting anything.
* **restart** — the index is rebuilt from a directory scan, ordered by mtime.
  Every write and hit sets the file's mtime from a strictly increasing clock,
  so the LRU order survives a restart exactly (on filesystems with ns mtimes).
  Stray temporary files of a crashed writer are removed. Checksums are checked
  lazily, on read. Each block's parent is appended to ``links`` as it is
  stored (``put_links``), so a new process can rebuild its prefix index from
  the directory (``links()``: the links whose blob is still here; the file is
  compacted to them as it is read; a torn last line is skipped).

One store object owns a namespace directory at a time (an exclusive ``flock``
on ``.lock``): the index is per process, and two writers would each believe
their own view of capacity. Engines on different machines share blocks
through Redis, not through a shared directory.
"""

from __future__ import annotations

import contextlib
import errno
import io
import itertools
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from pathlib import Path

import xxhash

from kvflow.errors import ConfigError
from kvflow.stores.base import (
    HEADER_SIZE,
    BlockStore,
    Link,
    Namespace,
    StoreStats,
    encode_header,
    encode_key,
    parse_header,
    storage_name,
    verify_parts,
)

try:  # POSIX only; elsewhere the directory is simply not locked
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None  # type: ignore[assignment]

TMP_PREFIX = ".tmp-"
LOCK_NAME = ".lock"
LINKS_NAME = "links"
_HEX = frozenset("0123456789abcdef")


def _fanout(name: str) -> str:
    return xxhash.xxh3_64_hexdigest(name.encode())[:2]


def _write_all(fd: int, data: memoryview | bytes) -> None:
    view = memoryview(data)
    while view.nbytes:
        n = os.write(fd, view)
        if n <= 0:  # a zero-byte write would loop forever; treat it as the error it is
            raise OSError(errno.EIO, "write returned 0 bytes")
        view = view[n:]


def _read_exact(f: io.FileIO, n: int) -> bytes:
    """``n`` bytes (fewer only at end of file); one read call in the usual case."""
    data = f.read(n) or b""
    if len(data) < n:  # a short read (signal, odd filesystem): keep going to EOF
        parts = [data]
        got = len(data)
        while got < n and (more := f.read(n - got)):
            parts.append(more)
            got += len(more)
        data = b"".join(parts)
    return data


class LocalDirStore(BlockStore):
    """Blocks as files under ``root/<namespace.name>``; see the module docstring.

    ``capacity_bytes=None`` means unbounded (the disk's own limit then shows up
    as failed puts). ``fsync`` makes every put durable before it answers.
    ``touch_on_read`` refreshes a hit's mtime so the LRU order survives restarts
    (one ``utime`` per hit).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        namespace: Namespace,
        capacity_bytes: int | None = None,
        *,
        fsync: bool = False,
        touch_on_read: bool = True,
    ) -> None:
        super().__init__(namespace)
        if capacity_bytes is not None and (
            not isinstance(capacity_bytes, int) or capacity_bytes <= 0
        ):
            raise ConfigError(f"capacity_bytes must be a positive integer or None, "
                              f"got {capacity_bytes!r}")
        self.root = Path(root)
        self.dir = self.root / namespace.name
        self.capacity_bytes = capacity_bytes
        self.fsync = fsync
        self.touch_on_read = touch_on_read
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # file name -> blob bytes, LRU first
        self._used = 0
        self._reserved = 0  # bytes of puts in flight (room made, file not yet in place)
        self._last_ns = 0
        self._tmp_seq = itertools.count()
        self._links_lock = threading.Lock()
        self._made_dirs: set[str] = set()
        self.removed_tmp_files = 0  # stray temporary files removed when opening
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock_fd: int | None = None
        self._acquire_dir_lock()
        try:
            self._rebuild()
        except BaseException:
            self._release_dir_lock()
            raise

    # ------------------------------------------------------------------ open / close

    def _acquire_dir_lock(self) -> None:
        if fcntl is None:  # pragma: no cover
            return
        fd = os.open(self.dir / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise ConfigError(
                f"block store directory {self.dir} is already open by another LocalDirStore "
                f"(close it first; one store object owns a namespace directory)"
            ) from None
        self._lock_fd = fd

    def _release_dir_lock(self) -> None:
        if self._lock_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._lock_fd)  # closing drops the flock
            self._lock_fd = None

    def close(self) -> None:
        if not self._closed:
            super().close()
            self._release_dir_lock()

    def _rebuild(self) -> None:
        """Index the blobs already on disk, oldest mtime first; drop stray temp files."""
        found: list[tuple[int, str, int]] = []
        with os.scandir(self.dir) as top:
            subdirs = [e for e in top if e.is_dir() and len(e.name) == 2 and set(e.name) <= _HEX]
        for sub in subdirs:
            self._made_dirs.add(sub.name)
            with os.scandir(sub.path) as it:
                for e in it:
                    if e.name.startswith(TMP_PREFIX):
                        with contextlib.suppress(OSError):
                            os.unlink(e.path)
                            self.removed_tmp_files += 1
                        continue
                    if not e.is_file(follow_symlinks=False) or _fanout(e.name) != sub.name:
                        continue  # not ours: leave it alone, do not count it
                    try:
                        st = e.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    found.append((st.st_mtime_ns, e.name, st.st_size))
        found.sort()
        for mtime, name, size in found:
            self._index[name] = size
            self._used += size
            self._last_ns = max(self._last_ns, mtime)
        if self.capacity_bytes is not None and self._used > self.capacity_bytes:
            # The capacity shrank since the last run: trim to it, oldest first.
            victims = []
            while self._index and self._used > self.capacity_bytes:
                name, size = self._index.popitem(last=False)
                self._used -= size
                victims.append(name)
            for name in victims:
                with contextlib.suppress(OSError):
                    os.unlink(self._file(name))
            self._count(StoreStats(evictions=len(victims)))

    # ------------------------------------------------------------------------ paths

    def _file(self, name: str) -> Path:
        return self.dir / _fanout(name) / name

    def path_for(self, key: Hashable) -> Path:
        """Where ``key``'s blob lives (whether or not it is there)."""
        return self._file(storage_name(encode_key(key)))

    def _tick(self) -> int:
        """A strictly increasing mtime (ns), so LRU order is exact after a restart."""
        with self._lock:
            self._last_ns = max(time.time_ns(), self._last_ns + 1)
            return self._last_ns

    # ---------------------------------------------------------------------- queries

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._used

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    def lru_order(self) -> list[str]:
        """File names, least recently used first (for tests and tools)."""
        with self._lock:
            return list(self._index)

    def contains_many(self, keys: Sequence[Hashable]) -> list[bool]:
        self._check_open()
        names = [storage_name(encode_key(k)) for k in keys]
        with self._lock:
            return [n in self._index for n in names]

    # ------------------------------------------------------------------------- get

    def _forget(self, name: str) -> None:
        with self._lock:
            size = self._index.pop(name, None)
            if size is not None:
                self._used -= size

    def _read_blob(self, path: Path, enc: str, into: memoryview | None) -> bytes | bool | None:
        """Read and verify the blob in ``path``. Raises OSError.

        Without ``into``: the payload, read straight into its own bytes object
        after the header (no second copy of the block), or ``None`` if the blob
        is bad. With ``into``: ``True`` once the payload is in ``into`` and
        verified, ``None`` if the blob is bad, ``False`` if the payload does
        not have ``into``'s size (a miss, not corruption).
        """
        ns = self.namespace
        with open(path, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(HEADER_SIZE) or b""
            parsed = parse_header(head)
            if parsed is None:
                return None
            sig_len, key_len, payload_len = parsed
            if size != HEADER_SIZE + sig_len + key_len + payload_len:
                return None
            if ns.block_bytes is not None and payload_len != ns.block_bytes:
                return None
            var = _read_exact(f, sig_len + key_len)
            if into is None:
                payload: bytes | memoryview = _read_exact(f, payload_len)
            else:
                if payload_len != into.nbytes:
                    return False
                got = 0
                while got < payload_len and (n := f.readinto(into[got:])):
                    got += n
                payload = into[:got]
        if not verify_parts(head, var, payload, ns.layout, enc, ns.block_bytes):
            return None
        return True if into is not None else payload

    def _get(
        self, keys: Sequence[Hashable], into: Sequence[memoryview] | None
    ) -> list[bytes | bool | None]:
        self._check_open()
        encoded = [encode_key(k) for k in keys]
        out: list[bytes | bool | None] = []
        delta = StoreStats()
        for i, enc in enumerate(encoded):
            name = storage_name(enc)
            with self._lock:
                present = name in self._index
            if not present:
                delta.misses += 1
                out.append(None)
                continue
            path = self._file(name)
            try:
                got = self._read_blob(path, enc, None if into is None else into[i])
            except FileNotFoundError:  # removed behind our back: just a miss
                self._forget(name)
                delta.misses += 1
                out.append(None)
                continue
            except OSError as exc:
                self._note_error(exc)
                delta.errors += 1
                delta.misses += 1
                out.append(None)
                continue
            if got is None:
                self._forget(name)
                with contextlib.suppress(OSError):
                    os.unlink(path)
                delta.corrupt += 1
                delta.misses += 1
                out.append(None)
                continue
            if got is False:
                delta.misses += 1
                out.append(None)
                continue
            delta.hits += 1
            delta.bytes_read += into[i].nbytes if into is not None else len(got)
            out.append(got)
            with self._lock:
                if name in self._index:
                    self._index.move_to_end(name)
            if self.touch_on_read:
                t = self._tick()
                with contextlib.suppress(OSError):
                    os.utime(path, ns=(t, t))
        self._count(delta)
        return out

    def get_many(self, keys: Sequence[Hashable]) -> list[bytes | None]:
        return self._get(keys, None)  # type: ignore[return-value]

    def get_many_into(self, keys: Sequence[Hashable], buffers: Sequence[object]) -> list[bool]:
        """Read each payload straight into its buffer with ``readinto`` (no allocation)."""
        views = self._check_buffers(keys, buffers)
        return [r is True for r in self._get(keys, views)]

    # ------------------------------------------------------------------------- put

    def _reserve(self, name: str, size: int) -> tuple[bool, bool]:
        """Drop ``name``'s old entry and make room for ``size`` bytes, evicting LRU blobs.

        Returns ``(fits, had_old)``. A put replaces: the old entry leaves the
        index now, and its file is replaced by the write or removed if the
        write fails, so disk and index never disagree about a key.
        """
        with self._lock:
            old = self._index.pop(name, None)
            if old is not None:
                self._used -= old
            cap = self.capacity_bytes
            victims: list[str] = []
            if cap is None:
                fits = True
            elif size > cap:
                fits = False  # larger than the whole store: evict nothing for it
            else:
                while self._used + self._reserved + size > cap and self._index:
                    victim, vsize = self._index.popitem(last=False)
                    self._used -= vsize
                    victims.append(victim)
                # Still short only while other puts in flight hold the rest: give up.
                fits = self._used + self._reserved + size <= cap
            if fits:
                self._reserved += size
        for victim in victims:
            with contextlib.suppress(OSError):
                os.unlink(self._file(victim))
        if victims:
            self._count(StoreStats(evictions=len(victims)))
        return fits, old is not None

    def _write_file(self, name: str, header: bytes, payload: memoryview) -> None:
        """Write one blob atomically; on failure nothing new is visible and the temp is gone."""
        sub = _fanout(name)
        d = self.dir / sub
        if sub not in self._made_dirs:
            d.mkdir(exist_ok=True)
            self._made_dirs.add(sub)
        tmp = d / f"{TMP_PREFIX}{name}-{os.getpid()}-{threading.get_ident()}-{next(self._tmp_seq)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            try:
                _write_all(fd, header)
                _write_all(fd, payload)
                if self.fsync:
                    os.fsync(fd)
                t = self._tick()
                if os.utime in os.supports_fd:
                    os.utime(fd, ns=(t, t))
            finally:
                os.close(fd)
            if os.utime not in os.supports_fd:  # pragma: no cover
                os.utime(tmp, ns=(t, t))
            os.replace(tmp, self._file(name))
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        if self.fsync:
            dfd = os.open(d, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)

    def put_many(self, items: Sequence[tuple[Hashable, bytes]]) -> list[bool]:
        self._check_open()
        # Check the whole batch first: a caller bug raises before anything is written.
        prepared = [
            (storage_name(enc := encode_key(k)), enc, self._check_payload(k, p)) for k, p in items
        ]
        out: list[bool] = []
        delta = StoreStats()
        for name, enc, payload in prepared:
            header = encode_header(self.namespace.layout, enc, payload)
            size = len(header) + payload.nbytes
            fits, had_old = self._reserve(name, size)
            if not fits:
                if had_old:
                    with contextlib.suppress(OSError):
                        os.unlink(self._file(name))
                delta.put_failed += 1
                out.append(False)
                continue
            try:
                self._write_file(name, header, payload)
            except OSError as exc:
                with self._lock:
                    self._reserved -= size
                if had_old:
                    with contextlib.suppress(OSError):
                        os.unlink(self._file(name))
                self._note_error(exc)
                delta.put_failed += 1
                delta.errors += 1
                out.append(False)
                continue
            with self._lock:
                self._reserved -= size
                old = self._index.pop(name, None)  # a concurrent put of the same key
                if old is not None:
                    self._used -= old
                self._index[name] = size
                self._used += size
            delta.put_ok += 1
            delta.bytes_written += payload.nbytes
            out.append(True)
        self._count(delta)
        return out

    # ---------------------------------------------------------------------- delete

    def delete(self, key: Hashable) -> bool:
        self._check_open()
        name = storage_name(encode_key(key))
        with self._lock:
            size = self._index.pop(name, None)
            if size is not None:
                self._used -= size
        try:
            os.unlink(self._file(name))
        except FileNotFoundError:
            return size is not None
        except OSError as exc:
            self._note_error(exc)
            self._count(StoreStats(errors=1))
        return True

    # ----------------------------------------------------------------------- links

    def put_links(self, items: Sequence[Link]) -> bool:
        self._check_open()
        if not items:
            return True
        lines = "".join(f"{a} {b}\n" for a, b in (self._encode_link(k, p) for k, p in items))
        try:
            with self._links_lock, open(self.dir / LINKS_NAME, "a", encoding="ascii") as f:
                f.write(lines)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
        except OSError as exc:
            self._note_error(exc)
            self._count(StoreStats(errors=1))
            return False
        return True

    def links(self) -> list[Link]:
        """Links of the blobs present now (the last line of a key wins); the file is
        rewritten to hold only those."""
        self._check_open()
        path = self.dir / LINKS_NAME
        latest: dict[str, str] = {}
        try:
            with self._links_lock:
                with open(path, encoding="ascii", errors="replace") as f:
                    for line in f:
                        parts = line.split()
                        if len(parts) in (1, 2) and line.endswith("\n"):
                            latest[parts[0]] = parts[1] if len(parts) == 2 else ""
                with self._lock:
                    live = {k: p for k, p in latest.items() if storage_name(k) in self._index}
                tmp = path.with_name(f"{TMP_PREFIX}{LINKS_NAME}-{os.getpid()}")
                with open(tmp, "w", encoding="ascii") as f:
                    f.write("".join(f"{k} {p}\n" for k, p in live.items()))
                os.replace(tmp, path)
        except FileNotFoundError:
            return []
        except OSError as exc:
            self._note_error(exc)
            self._count(StoreStats(errors=1))
            return []
        out = [self._decode_link(k, p) for k, p in live.items()]
        return [link for link in out if link is not None]

    def clear(self) -> None:
        """Delete every blob of this namespace."""
        self._check_open()
        with self._lock:
            names = list(self._index)
            self._index.clear()
            self._used = 0
        for name in names:
            with contextlib.suppress(OSError):
                os.unlink(self._file(name))
        with self._links_lock, contextlib.suppress(OSError):
            os.unlink(self.dir / LINKS_NAME)

    def __repr__(self) -> str:
        return (f"LocalDirStore({str(self.dir)!r}, blocks={len(self._index)}, "
                f"used={self._used}, capacity={self.capacity_bytes})")
