"""Keyed MACs for blocks in shared stores: a block nobody with the key wrote is a miss.

The blob checksum (xxh3) catches corruption, not forgery: anyone who can write
to a shared Redis can compute it and plant a block under another tenant's
namespace. Blocks in a shared store therefore carry an HMAC-SHA256 tag over
the whole blob before it (header, checksum, layout signature, key, payload).

Keys:

* the **deployment key** is secret bytes shared by every engine of one
  deployment. It comes from a file named by ``KVFLOW_STORE_KEY_FILE`` or from
  ``KVFLOW_STORE_KEY`` (hex), never from a command line, where other users of
  the machine could read it in the process list (:func:`load_deployment_key`);
* each **namespace** (model + layout + tenant salt) tags with its own key,
  derived from the deployment key and the namespace's identity, so a tag made
  for one tenant's block never verifies under another tenant's namespace.

HMAC-SHA256 rather than keyed BLAKE2b: with the SHA extensions of current
x86 and Arm CPUs it runs at ~1.7 GB/s a core against BLAKE2b's ~0.9 GB/s
(measured on the development VM), and a MAC is paid on every block moved.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import stat
from pathlib import Path

from kvflow.errors import ConfigError
from kvflow.stores.base import Namespace

#: Environment variables a deployment key is read from (the file one first).
KEY_FILE_ENV = "KVFLOW_STORE_KEY_FILE"
KEY_ENV = "KVFLOW_STORE_KEY"
#: Bytes of a tag (HMAC-SHA256) and the least key material accepted.
TAG_SIZE = 32
MIN_KEY_BYTES = 16

log = logging.getLogger("kvflow.stores")


def load_deployment_key(env: dict[str, str] | None = None) -> bytes | None:
    """The deployment key from ``KVFLOW_STORE_KEY_FILE`` (a file of raw bytes, or of hex
    text) or ``KVFLOW_STORE_KEY`` (hex); ``None`` when neither is set.

    A key shorter than 16 bytes, text that is neither, or an unreadable file is
    a ``ConfigError`` naming the variable. A key file that other users may read
    is used, with a warning.
    """
    env = os.environ if env is None else env  # type: ignore[assignment]
    path = env.get(KEY_FILE_ENV, "").strip()
    if path:
        try:
            raw = Path(path).read_bytes()
            mode = os.stat(path).st_mode
        except OSError as exc:
            raise ConfigError(f"{KEY_FILE_ENV}={path}: cannot read the key file "
                              f"({exc.strerror or exc})") from None
        if mode & (stat.S_IRGRP | stat.S_IROTH):
            log.warning("store key file %s is readable by other users (chmod 600 it)", path)
        return _key_bytes(raw, KEY_FILE_ENV)
    text = env.get(KEY_ENV, "").strip()
    if text:
        try:
            key = bytes.fromhex(text)
        except ValueError:
            raise ConfigError(f"{KEY_ENV} must be hex digits (e.g. from "
                              "'openssl rand -hex 32')") from None
        return _key_bytes(key, KEY_ENV)
    return None


def _key_bytes(raw: bytes, where: str) -> bytes:
    text = raw.strip()
    try:  # a file of hex text (openssl rand -hex 32 > key) is the usual form
        key = bytes.fromhex(text.decode("ascii")) if text else b""
    except (UnicodeDecodeError, ValueError):
        key = raw  # raw random bytes (head -c 32 /dev/urandom > key)
    if len(key) < MIN_KEY_BYTES:
        raise ConfigError(f"{where}: the store key has {len(key)} bytes; at least "
                          f"{MIN_KEY_BYTES} are needed (openssl rand -hex 32)")
    return key


class BlockMac:
    """Tags and checks blobs of one namespace with the key derived for it."""

    __slots__ = ("_key", "key_id")

    def __init__(self, deployment_key: bytes, namespace: Namespace) -> None:
        if len(deployment_key) < MIN_KEY_BYTES:
            raise ConfigError(f"a store key needs at least {MIN_KEY_BYTES} bytes")
        identity = b"\0".join((
            namespace.model.encode(), namespace.layout.encode(),
            b"nosalt" if namespace.tenant_salt is None else b"salt:" + namespace.tenant_salt,
        ))
        self._key = hmac.digest(deployment_key, b"kvflow-ns-key\0" + identity, "sha256")
        #: A public fingerprint of the derived key (logs, reports); reveals nothing of it.
        self.key_id = hashlib.sha256(b"kvflow-key-id\0" + self._key).hexdigest()[:8]

    def tag(self, *parts: bytes | memoryview) -> bytes:
        h = hmac.new(self._key, digestmod=hashlib.sha256)
        for p in parts:
            h.update(p)
        return h.digest()

    def verify(self, tag: bytes | memoryview, *parts: bytes | memoryview) -> bool:
        return hmac.compare_digest(bytes(tag), self.tag(*parts))

    def __repr__(self) -> str:
        return f"BlockMac(key_id={self.key_id})"  # never the key
