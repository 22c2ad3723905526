"""A block store in Redis: blocks shared between engines on different machines.

Each block is one Redis string ``<prefix>:<namespace.name>:<key>`` holding the
same checksummed blob as a local file (see ``kvflow.stores.base``). Gets go out
as ``MGET`` and puts as non-transactional pipelines of ``SET`` (optionally with
a TTL), ``batch_size`` keys per round trip, so a batch of blocks costs one
round trip per ``batch_size`` keys, not one per block.

Failure semantics (the store is a cache; the caller recomputes):

* the server is unreachable, times out or refuses a command (``OOM`` when it
  is at ``maxmemory`` with ``noeviction``) -> the affected gets are misses, the
  affected puts ``False``; ``errors`` counts each failed round trip or refused
  command; the exception is never raised to the caller.
* after a connection failure the store stays *down* for ``retry_interval_s``:
  calls answer at once (misses / ``False``, counted as errors) instead of
  paying a connect timeout each. The first call after that interval tries
  again; redis-py's pool reconnects, so the store serves again as soon as the
  server is back (same address), with no action by the caller.
* a blob failing its checksum or header check is a miss counted as
  ``corrupt`` and is deleted.

Authentication (anyone who can write to a shared Redis could otherwise plant
blocks for any tenant): every blob carries a keyed MAC (``kvflow.stores.mac``)
under a key derived per namespace from the deployment key, given as
``mac_key`` or read from ``KVFLOW_STORE_KEY_FILE`` / ``KVFLOW_STORE_KEY``. A
blob without a valid MAC is a miss counted as ``forged`` (or ``corrupt`` when
its checksum fails too), logged, and deleted. With no key the store refuses
to start unless ``authenticate=False`` says the Redis is private to one
trusted writer.

Server access: ``redis://[user[:password]@]host:port/db`` authenticates (Redis
AUTH, ACL users too) and ``rediss://...`` speaks TLS (certificates checked
against the system's CAs, or ``ssl_ca_certs``); the host/port form takes
``username``, ``password``, ``ssl``. A password never appears in ``address``.

Capacity is the server's business (``maxmemory`` plus an eviction policy such
as ``allkeys-lru``); ``evictions`` stays 0 here. ``redis`` (redis-py) is an
optional extra: it is imported when a ``RedisStore`` is created.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Hashable, Sequence
from typing import Any

from kvflow.errors import ConfigError
from kvflow.stores.base import (
    BlockStore,
    Link,
    MissingDependencyError,
    Namespace,
    StoreStats,
    encode_blob,
    encode_key,
    failure_kind,
    payload_view,
    storage_name,
)
from kvflow.stores.mac import KEY_ENV, KEY_FILE_ENV, BlockMac, load_deployment_key, log

#: Forged blobs logged one by one before the log goes to one line per 1,000.
_LOGGED_FORGERIES = 10


def _import_redis() -> Any:
    try:
        import redis
    except ImportError as exc:
        raise MissingDependencyError(
            "RedisStore needs the 'redis' package: pip install 'kvflow[redis]'"
        ) from exc
    return redis


class RedisStore(BlockStore):
    """Blocks in a Redis server; see the module docstring for the failure semantics.

    Give either ``url`` (``redis://[[user]:password@]host:port/db``, ``rediss://`` for
    TLS) or ``host`` / ``port`` / ``db`` / ``username`` / ``password`` / ``ssl``.
    ``mac_key`` is the deployment key (default: from the environment, see the
    module docstring); ``authenticate=False`` stores plain checksummed blobs
    and accepts only those. ``ttl_s`` sets an expiry on every block
    (``None``: none). ``socket_timeout`` bounds one round trip (a hung server
    costs a worker thread at most that long); ``connect_timeout`` one connect.
    ``socket_read_size`` is redis-py's receive chunk: blocks are hundreds of KB,
    and its 32 KB default costs many parser rounds per block (the pure-Python
    parser; ``hiredis``, where installed, is faster still).
    """

    def __init__(
        self,
        namespace: Namespace,
        url: str | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 6379,
        db: int = 0,
        username: str | None = None,
        password: str | None = None,
        ssl: bool = False,
        ssl_ca_certs: str | None = None,
        mac_key: bytes | None = None,
        authenticate: bool = True,
        ttl_s: float | None = None,
        socket_timeout: float = 1.0,
        connect_timeout: float = 1.0,
        retry_interval_s: float = 1.0,
        batch_size: int = 64,
        max_connections: int = 32,
        socket_read_size: int = 1 << 20,
        key_prefix: str = "kvflow",
    ) -> None:
        super().__init__(namespace)
        redis = _import_redis()
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        if ttl_s is not None and ttl_s <= 0:
            raise ConfigError(f"ttl_s must be positive or None, got {ttl_s!r}")
        if batch_size <= 0:
            raise ConfigError(f"batch_size must be positive, got {batch_size!r}")
        if retry_interval_s < 0:
            raise ConfigError(f"retry_interval_s must be >= 0, got {retry_interval_s!r}")
        if authenticate:
            key = mac_key if mac_key is not None else load_deployment_key()
            if key is None:
                raise ConfigError(
                    f"a shared store needs a deployment key to authenticate its blocks: "
                    f"set {KEY_FILE_ENV} to a file holding one (openssl rand -hex 32) or "
                    f"{KEY_ENV}; authenticate=False only for a Redis no one else writes")
            self._mac: BlockMac | None = BlockMac(key, namespace)
        else:
            self._mac = None
        self._forgeries = 0
        self.ttl_s = ttl_s
        self.batch_size = batch_size
        self.retry_interval_s = retry_interval_s
        self._prefix = f"{key_prefix}:{namespace.name}:".encode()
        # One immediate retry on a connection error: after a server restart the
        # pooled sockets are dead and the retry reconnects. No retry on timeouts
        # (that would double the wait) and no backoff (the caller has a deadline).
        opts: dict[str, Any] = dict(
            socket_timeout=socket_timeout,
            socket_connect_timeout=connect_timeout,
            retry=Retry(NoBackoff(), 1, supported_errors=(redis.exceptions.ConnectionError,)),
            max_connections=max_connections,
            socket_read_size=socket_read_size,
        )
        if ssl_ca_certs is not None:
            opts["ssl_ca_certs"] = ssl_ca_certs
        if url is not None:
            scheme = url.split("://", 1)[0].lower()
            if scheme not in ("redis", "rediss", "unix"):
                raise ConfigError(f"unsupported Redis URL scheme {scheme!r}: use redis:// "
                                  "or rediss:// (TLS)")
            if scheme != "rediss":
                opts.pop("ssl_ca_certs", None)
            self._client = redis.Redis.from_url(url, **opts)
            self.address = redact_url(url)
        else:
            if not ssl:
                opts.pop("ssl_ca_certs", None)
            self._client = redis.Redis(host=host, port=port, db=db, username=username,
                                       password=password, ssl=ssl, **opts)
            self.address = f"{'rediss' if ssl else 'redis'}://{host}:{port}/{db}"
        self._errors = redis.exceptions.RedisError
        self._conn_errors = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)
        self._down_until = 0.0
        self._down_lock = threading.Lock()

    # ------------------------------------------------------------------ helpers

    def _rkey(self, enc: str) -> bytes:
        return self._prefix + storage_name(enc).encode()

    def _is_down(self) -> bool:
        return time.monotonic() < self._down_until

    def _failed(self, exc: BaseException, delta: StoreStats) -> None:
        """Count one failed round trip; a connection failure marks the server down."""
        self._note_error(exc)
        delta.errors += 1
        if isinstance(exc, self._conn_errors):
            with self._down_lock:
                self._down_until = time.monotonic() + self.retry_interval_s

    def _log_forgery(self, enc: str) -> None:
        self._forgeries += 1
        n = self._forgeries
        if n <= _LOGGED_FORGERIES:
            log.warning("%s: block %s in namespace %s has no valid MAC (key id %s): "
                        "treated as a miss and deleted", self.address, enc,
                        self.namespace.name, self._mac.key_id if self._mac else "-")
        elif n % 1000 == 0:
            log.warning("%s: %d blocks without a valid MAC so far", self.address, n)

    @property
    def is_down(self) -> bool:
        """Whether calls are being answered without trying the server (after a failure)."""
        return self._is_down()

    def ping(self) -> bool:
        """Whether the server answers now (ignores and resets the down window)."""
        try:
            ok = bool(self._client.ping())
        except self._errors:
            return False
        if ok:
            self._down_until = 0.0
        return ok

    def _chunks(self, n: int) -> range:
        return range(0, n, self.batch_size)

    # ---------------------------------------------------------------------- API

    def _get(
        self, keys: Sequence[Hashable], into: Sequence[memoryview] | None
    ) -> list[bytes | bool | None]:
        self._check_open()
        encoded = [encode_key(k) for k in keys]
        out: list[bytes | bool | None] = [None] * len(encoded)
        delta = StoreStats()
        bad: list[bytes] = []
        ns = self.namespace
        for lo in self._chunks(len(encoded)):
            chunk = encoded[lo:lo + self.batch_size]
            if self._is_down():
                delta.errors += 1
                continue
            try:
                blobs = self._client.mget([self._rkey(e) for e in chunk])
            except self._errors as exc:
                self._failed(exc, delta)
                continue
            for i, (enc, blob) in enumerate(zip(chunk, blobs, strict=True)):
                if blob is None:
                    continue
                view = payload_view(blob, ns.layout, enc, ns.block_bytes, self._mac)
                if view is None:
                    if self._mac is not None and failure_kind(
                            blob, ns.layout, enc, ns.block_bytes) == "forged":
                        delta.forged += 1
                        self._log_forgery(enc)
                    else:
                        delta.corrupt += 1
                    bad.append(self._rkey(enc))
                    continue
                if into is None:
                    out[lo + i] = bytes(view)
                elif view.nbytes == into[lo + i].nbytes:
                    into[lo + i][:] = view  # one copy, into memory the caller already has
                    out[lo + i] = True
                else:
                    continue  # another size than its buffer: a miss, not corruption
                delta.hits += 1
                delta.bytes_read += view.nbytes
        delta.misses += sum(1 for p in out if p is None)
        if bad:
            try:
                self._client.delete(*bad)
            except self._errors as exc:
                self._failed(exc, delta)
        self._count(delta)
        return out

    def get_many(self, keys: Sequence[Hashable]) -> list[bytes | None]:
        return self._get(keys, None)  # type: ignore[return-value]

    def get_many_into(self, keys: Sequence[Hashable], buffers: Sequence[object]) -> list[bool]:
        """Verify each blob in the reply buffer and copy its payload once, into the caller's."""
        views = self._check_buffers(keys, buffers)
        return [r is True for r in self._get(keys, views)]

    def put_many(self, items: Sequence[tuple[Hashable, bytes]]) -> list[bool]:
        self._check_open()
        prepared = [(encode_key(k), self._check_payload(k, p)) for k, p in items]
        out = [False] * len(prepared)
        delta = StoreStats()
        px = None if self.ttl_s is None else max(1, round(self.ttl_s * 1000))
        for lo in self._chunks(len(prepared)):
            chunk = prepared[lo:lo + self.batch_size]
            if self._is_down():
                delta.errors += 1
                continue
            pipe = self._client.pipeline(transaction=False)
            for enc, payload in chunk:
                pipe.set(self._rkey(enc), encode_blob(self.namespace.layout, enc, payload,
                                                      self._mac), px=px)
            try:
                results = pipe.execute(raise_on_error=False)
            except self._errors as exc:
                self._failed(exc, delta)
                continue
            finally:
                pipe.reset()
            for i, ((_, payload), res) in enumerate(zip(chunk, results, strict=True)):
                if isinstance(res, BaseException):  # e.g. OOM at maxmemory with noeviction
                    self._failed(res, delta)
                elif res:
                    out[lo + i] = True
                    delta.put_ok += 1
                    delta.bytes_written += payload.nbytes
        delta.put_failed += sum(1 for ok in out if not ok)
        self._count(delta)
        return out

    def contains_many(self, keys: Sequence[Hashable]) -> list[bool]:
        self._check_open()
        encoded = [encode_key(k) for k in keys]
        out = [False] * len(encoded)
        delta = StoreStats()
        for lo in self._chunks(len(encoded)):
            chunk = encoded[lo:lo + self.batch_size]
            if self._is_down():
                delta.errors += 1
                continue
            pipe = self._client.pipeline(transaction=False)
            for enc in chunk:
                pipe.exists(self._rkey(enc))
            try:
                results = pipe.execute()
            except self._errors as exc:
                self._failed(exc, delta)
                continue
            finally:
                pipe.reset()
            for i, res in enumerate(results):
                out[lo + i] = bool(res)
        self._count(delta)
        return out

    def delete(self, key: Hashable) -> bool:
        self._check_open()
        delta = StoreStats()
        if self._is_down():  # like every data call: no connect tried while down
            delta.errors += 1
            self._count(delta)
            return False
        try:
            n = self._client.delete(self._rkey(encode_key(key)))
        except self._errors as exc:
            self._failed(exc, delta)
            self._count(delta)
            return False
        return bool(n)

    # ----------------------------------------------------------------------- links

    @property
    def _links_key(self) -> bytes:
        # Block keys continue the prefix with i, h, s or z: "~" never collides.
        return self._prefix + b"~links"

    def put_links(self, items: Sequence[Link]) -> bool:
        """One ``HSET`` of ``encoded key -> encoded parent`` into the namespace's hash.
        (Links carry no MAC: a forged one can only name a block, which is then read
        and verified like any other, or misses.)"""
        self._check_open()
        if not items:
            return True
        delta = StoreStats()
        if self._is_down():
            delta.errors += 1
            self._count(delta)
            return False
        try:
            self._client.hset(self._links_key, mapping=dict(
                self._encode_link(k, p) for k, p in items))
        except self._errors as exc:
            self._failed(exc, delta)
            self._count(delta)
            return False
        return True

    def links(self) -> list[Link]:
        """Every recorded link (``HSCAN``), whether or not its block is still held."""
        self._check_open()
        delta = StoreStats()
        if self._is_down():
            delta.errors += 1
            self._count(delta)
            return []
        out: list[Link] = []
        try:
            for enc, parent in self._client.hscan_iter(self._links_key, count=1000):
                link = self._decode_link(enc.decode("ascii", "replace"),
                                         parent.decode("ascii", "replace"))
                if link is not None:
                    out.append(link)
        except self._errors as exc:
            self._failed(exc, delta)
            self._count(delta)
            return []
        return out

    def forget_links(self, keys: Sequence[Hashable]) -> None:
        """Drop the links of blocks found gone (``HDEL``); store trouble is ignored."""
        self._check_open()
        if not keys or self._is_down():
            return
        with contextlib.suppress(self._errors):
            self._client.hdel(self._links_key, *(encode_key(k) for k in keys))

    def clear(self) -> int:
        """Delete every block of this namespace (SCAN + UNLINK), its links too; how many
        blocks were deleted.

        A maintenance call, not on the data path: redis-py errors propagate.
        """
        self._check_open()
        n = 0
        batch: list[bytes] = []
        self._client.unlink(self._links_key)
        for k in self._client.scan_iter(match=self._prefix + b"*", count=1000):
            if k == self._links_key:
                continue
            batch.append(k)
            if len(batch) >= 1000:
                n += self._client.unlink(*batch)
                batch.clear()
        if batch:
            n += self._client.unlink(*batch)
        return n

    def close(self) -> None:
        if not self._closed:
            super().close()
            with contextlib.suppress(self._errors):
                self._client.close()

    def __repr__(self) -> str:
        return f"RedisStore({self.address!r}, namespace={self.namespace.name!r})"


def redact_url(url: str) -> str:
    """``url`` with any password replaced by ``***`` (for reprs, reports and logs)."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))
