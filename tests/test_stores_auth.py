"""Issue 20 item 10: blocks in a shared store cannot be forged; Redis AUTH and TLS.

The blob checksum (xxh3) is no defence against someone who can write to a
shared Redis: they compute it too. Blocks there carry a keyed MAC under a
per-namespace key derived from a deployment key (file or environment
variable), and a blob without a valid one is a miss, counted and logged.
The Redis half runs against real ``redis-server`` processes: one requiring a
password (and an ACL user), one speaking TLS with a throwaway certificate.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
from pathlib import Path

import pytest

from kvflow.errors import ConfigError
from kvflow.stores import MemoryStore, Namespace, decode_blob, encode_blob, encode_key
from kvflow.stores.base import FLAG_MAC, failure_kind, is_tagged
from kvflow.stores.mac import BlockMac, load_deployment_key
from kvflow.stores.redis_server import LocalRedisServer, find_redis_server

KEY = bytes.fromhex("6b" * 32)
ALICE = Namespace("m", "raw", tenant_salt=b"alice")
BOB = Namespace("m", "raw", tenant_salt=b"bob")
ENC = encode_key(42)


# -- the MAC, no server ---------------------------------------------------------------
def test_a_tagged_blob_reads_back_only_under_its_own_namespace_key() -> None:
    mac = BlockMac(KEY, ALICE)
    blob = encode_blob("raw", ENC, b"payload", mac)
    assert is_tagged(blob) and blob[6] == FLAG_MAC
    assert decode_blob(blob, "raw", ENC, mac=mac) == b"payload"
    assert decode_blob(blob, "raw", ENC, mac=BlockMac(KEY, BOB)) is None  # another tenant
    assert decode_blob(blob, "raw", ENC, mac=BlockMac(b"x" * 32, ALICE)) is None  # another key
    assert decode_blob(blob, "raw", ENC) is None  # a plain reader takes no tagged blob
    for i in range(len(blob)):  # any byte changed, anywhere: refused
        bad = bytearray(blob)
        bad[i] ^= 0x01
        assert decode_blob(bytes(bad), "raw", ENC, mac=mac) is None, i


def test_a_forger_who_fixes_the_checksum_is_refused_and_named_as_such() -> None:
    mac = BlockMac(KEY, BOB)
    plain = encode_blob("raw", ENC, b"poison")  # what anyone can write: checksum right
    assert decode_blob(plain, "raw", ENC) == b"poison"  # the checksum alone accepts it
    assert decode_blob(plain, "raw", ENC, mac=mac) is None
    assert failure_kind(plain, "raw", ENC) == "forged"
    stolen = encode_blob("raw", ENC, b"alice's", BlockMac(KEY, ALICE))  # replayed to bob
    assert decode_blob(stolen, "raw", ENC, mac=mac) is None
    assert failure_kind(stolen, "raw", ENC) == "forged"
    torn = encode_blob("raw", ENC, b"payload", mac)[:-1]
    assert failure_kind(torn, "raw", ENC) == "corrupt"


def test_the_deployment_key_comes_from_a_file_or_the_environment(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    hexfile = tmp_path / "key.hex"
    hexfile.write_text(KEY.hex() + "\n")
    hexfile.chmod(0o600)
    assert load_deployment_key({"KVFLOW_STORE_KEY_FILE": str(hexfile)}) == KEY
    raw = tmp_path / "key.bin"
    raw.write_bytes(b"\xff\x00" * 16)
    raw.chmod(0o600)
    assert load_deployment_key({"KVFLOW_STORE_KEY_FILE": str(raw)}) == b"\xff\x00" * 16
    assert load_deployment_key({"KVFLOW_STORE_KEY": KEY.hex()}) == KEY
    assert load_deployment_key({}) is None
    with caplog.at_level(logging.WARNING, logger="kvflow.stores"):
        raw.chmod(0o644)
        load_deployment_key({"KVFLOW_STORE_KEY_FILE": str(raw)})
    assert "readable by other users" in caplog.text
    for env, words in (({"KVFLOW_STORE_KEY": "abcd"}, "at least 16"),
                       ({"KVFLOW_STORE_KEY": "not hex"}, "hex digits"),
                       ({"KVFLOW_STORE_KEY_FILE": str(tmp_path / "nope")}, "cannot read")):
        with pytest.raises(ConfigError, match=words):
            load_deployment_key(env)
    assert KEY.hex() not in repr(BlockMac(KEY, ALICE))


def test_a_local_store_keeps_plain_checksummed_blobs() -> None:
    s = MemoryStore(ALICE)
    assert s.put(1, b"x") and s.get(1) == b"x"


# -- Redis: forgery, AUTH, TLS, for real -----------------------------------------------
needs_redis = pytest.mark.skipif(find_redis_server() is None,
                                 reason="redis-server not on PATH (apt-get install redis-server)")
redis = pytest.importorskip("redis", reason="redis-py not installed: pip install 'kvflow[redis]'")
from kvflow.stores import RedisStore  # noqa: E402


@pytest.fixture
def server():
    with LocalRedisServer(password="s3cret-pw", acl_users=["alice on >wonder ~* &* +@all"]) as s:
        yield s


def test_a_redis_store_needs_a_key_or_an_explicit_opt_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVFLOW_STORE_KEY_FILE", raising=False)
    monkeypatch.delenv("KVFLOW_STORE_KEY", raising=False)
    with pytest.raises(ConfigError, match="KVFLOW_STORE_KEY_FILE"):
        RedisStore(ALICE, "redis://127.0.0.1:1/0")
    RedisStore(ALICE, "redis://127.0.0.1:1/0", authenticate=False).close()
    monkeypatch.setenv("KVFLOW_STORE_KEY", KEY.hex())
    RedisStore(ALICE, "redis://127.0.0.1:1/0").close()  # the environment's key
    with pytest.raises(ConfigError, match="scheme"):
        RedisStore(ALICE, "http://127.0.0.1:1/0", mac_key=KEY)


@needs_redis
def test_a_block_planted_in_another_tenants_namespace_is_a_logged_miss(
        server: LocalRedisServer, caplog: pytest.LogCaptureFixture) -> None:
    alice = RedisStore(ALICE, server.url, mac_key=KEY)
    bob = RedisStore(BOB, server.url, mac_key=KEY)
    assert alice.put(42, b"alice's block") and bob.put(7, b"bob's block")
    raw = redis.Redis.from_url(server.url)
    target = bob._rkey(ENC)  # bob's key for block 42: anyone with access sees the names
    raw.set(target, encode_blob("raw", ENC, b"poison"))  # checksum right, no MAC
    with caplog.at_level(logging.WARNING, logger="kvflow.stores"):
        assert bob.get(42) is None
    st = bob.stats
    assert (st.forged, st.corrupt, st.misses) == (1, 0, 1)
    assert "no valid MAC" in caplog.text and raw.exists(target) == 0  # logged, deleted
    raw.set(target, raw.get(alice._rkey(ENC)))  # alice's genuine blob, replayed to bob
    assert bob.get(42) is None and bob.stats.forged == 2
    assert alice.get(42) == b"alice's block" and bob.get(7) == b"bob's block"
    other = RedisStore(BOB, server.url, mac_key=b"another deployment key")
    assert other.get(7) is None and other.stats.forged == 1
    for s in (alice, bob, other):
        s.close()


@needs_redis
def test_auth_with_a_password_or_an_acl_user_and_without(server: LocalRedisServer) -> None:
    host, port = server.host, server.port
    with_pw = RedisStore(ALICE, f"redis://:s3cret-pw@{host}:{port}/0", mac_key=KEY)
    assert with_pw.put(1, b"x") and with_pw.get(1) == b"x"
    assert "s3cret-pw" not in with_pw.address + repr(with_pw)
    user = RedisStore(ALICE, f"redis://alice:wonder@{host}:{port}/0", mac_key=KEY)
    assert user.get(1) == b"x" and "wonder" not in user.address
    kw = RedisStore(ALICE, host=host, port=port, username="alice", password="wonder",
                    mac_key=KEY)
    assert kw.get(1) == b"x"
    for url in (f"redis://{host}:{port}/0", f"redis://:wrong@{host}:{port}/0"):
        anon = RedisStore(ALICE, url, mac_key=KEY, retry_interval_s=0)
        assert anon.get(1) is None and anon.put(2, b"y") is False  # refused: misses
        assert anon.stats.errors >= 2 and "uthentication" in (anon.last_error or "")
        anon.close()
    for s in (with_pw, user, kw):
        s.close()


def _self_signed(tmp: Path) -> tuple[str, str]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_file, key_file = tmp / "cert.pem", tmp / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    os.chmod(key_file, 0o600)
    return str(cert_file), str(key_file)


@needs_redis
def test_tls_with_rediss_urls(tmp_path: Path) -> None:
    pytest.importorskip("cryptography")
    cert, key = _self_signed(tmp_path)
    with LocalRedisServer(password="pw-tls", tls=(cert, key, cert)) as srv:
        tls = RedisStore(ALICE, srv.tls_url, ssl_ca_certs=cert, mac_key=KEY)
        assert tls.address.startswith("rediss://") and "pw-tls" not in tls.address
        assert tls.put(1, b"over tls") and tls.get(1) == b"over tls"
        # the same blocks through the plain port: TLS carried them, nothing else changed
        plain = RedisStore(ALICE, srv.url, mac_key=KEY)
        assert plain.get(1) == b"over tls"
        # a certificate nobody vouches for (the system's CAs do not know it): refused
        untrusted = RedisStore(ALICE, srv.tls_url, mac_key=KEY, retry_interval_s=0)
        assert untrusted.get(1) is None and "ertificate" in (untrusted.last_error or "")
        # plain text to the TLS port: no answer a client would take
        confused = RedisStore(ALICE, f"redis://:pw-tls@{srv.host}:{srv.tls_port}/0",
                              mac_key=KEY, retry_interval_s=0, socket_timeout=2,
                              connect_timeout=2)
        assert confused.get(1) is None and confused.stats.errors >= 1
        for s in (tls, plain, untrusted, confused):
            s.close()
