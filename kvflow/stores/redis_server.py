"""Run a throwaway ``redis-server`` on a free loopback port (tests, benchmarks, local runs).

The storage tests and ``benchmarks/bench_stores.py`` need a real server they
can kill and restart on the same port (the fault scenarios). This starts one
with persistence off (``--save '' --appendonly no``), bound to 127.0.0.1, in a
temporary directory, and talks to it over a raw socket for readiness, so it
needs neither redis-py nor a running daemon.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from kvflow.errors import KvflowError


class RedisServerError(KvflowError):
    """redis-server is missing or did not start; the message says which and why."""


def find_redis_server() -> str | None:
    """Path of the ``redis-server`` binary, or ``None`` if it is not installed."""
    return shutil.which("redis-server")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _pings(host: str, port: int, timeout: float = 0.2, password: str | None = None) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            if password is not None:
                pw = password.encode()
                s.sendall(b"*2\r\n$4\r\nAUTH\r\n$%d\r\n%s\r\n" % (len(pw), pw))
                if not s.recv(64).startswith(b"+OK"):
                    return False
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class LocalRedisServer:
    """One ``redis-server`` child process on ``127.0.0.1:<port>``.

    ``start()`` waits until it answers PING; ``kill()`` is SIGKILL (a crash,
    for fault tests), ``stop()`` a clean shutdown; ``start()`` again reuses
    the same port so clients reconnect to the same address. ``extra_args`` go
    to the command line (``["--maxmemory", "1mb"]``).

    ``password`` turns on AUTH for the default user (``--requirepass``);
    ``acl_users`` adds ACL users (rules as ``--user`` takes them, e.g.
    ``"alice on >secret ~* &* +@all"``). ``tls`` = ``(cert file, key file, CA
    file)`` also listens with TLS on ``tls_port`` (``tls_url``), clients not
    asked for certificates; the plain port stays, on loopback, for readiness.
    """

    def __init__(
        self,
        port: int | None = None,
        *,
        binary: str | None = None,
        extra_args: list[str] | tuple[str, ...] = (),
        startup_timeout_s: float = 10.0,
        password: str | None = None,
        acl_users: list[str] | tuple[str, ...] = (),
        tls: tuple[str, str, str] | None = None,
    ) -> None:
        found = binary or find_redis_server()
        if found is None:
            raise RedisServerError(
                "redis-server not found on PATH (apt-get install redis-server)"
            )
        self.binary = found
        self.host = "127.0.0.1"
        self.port = port if port is not None else free_port(self.host)
        self.extra_args = list(extra_args)
        self.startup_timeout_s = startup_timeout_s
        self.password = password
        self.acl_users = list(acl_users)
        self.tls = tls
        self.tls_port = free_port(self.host) if tls is not None else None
        self._dir = tempfile.mkdtemp(prefix="kvflow-redis-")
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """``redis://`` URL of the plain port (with the password, if one is set)."""
        auth = f":{self.password}@" if self.password is not None else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    @property
    def tls_url(self) -> str:
        """``rediss://`` URL of the TLS port (with the password, if one is set)."""
        if self.tls_port is None:
            raise RedisServerError("this server was started without TLS")
        auth = f":{self.password}@" if self.password is not None else ""
        return f"rediss://{auth}{self.host}:{self.tls_port}/0"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def log_path(self) -> Path:
        return Path(self._dir) / "redis.log"

    def start(self) -> LocalRedisServer:
        if self.running:
            return self
        cmd = [
            self.binary, "--port", str(self.port), "--bind", self.host,
            "--save", "", "--appendonly", "no", "--daemonize", "no",
            "--dir", self._dir, "--logfile", str(self.log_path),
            *self.extra_args,
        ]
        secrets = []  # in a file only the owner reads, not on the command line
        if self.password is not None:
            secrets.append(f"requirepass {self.password}")
        secrets += [f"user {rule}" for rule in self.acl_users]
        if secrets:
            conf = Path(self._dir) / "auth.conf"
            fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write("\n".join(secrets) + "\n")
            cmd.insert(1, str(conf))
        if self.tls is not None:
            cert, key, ca = self.tls
            cmd += ["--tls-port", str(self.tls_port), "--tls-cert-file", cert,
                    "--tls-key-file", key, "--tls-ca-cert-file", ca,
                    "--tls-auth-clients", "no"]
        self._proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                break
            if _pings(self.host, self.port, password=self.password):
                return self
            time.sleep(0.01)
        log = ""
        with contextlib.suppress(OSError):
            log = self.log_path.read_text()[-2000:]
        self.kill()
        raise RedisServerError(
            f"redis-server on port {self.port} did not answer PING within "
            f"{self.startup_timeout_s} s; log tail:\n{log}"
        )

    def kill(self) -> None:
        """SIGKILL, like a crash: no shutdown, connections reset."""
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.send_signal(signal.SIGKILL)
            self._proc.wait()
            self._proc = None

    def pause(self) -> None:
        """SIGSTOP: the server holds connections but answers nothing (a hung or slow store)."""
        if self.running:
            assert self._proc is not None
            self._proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after :meth:`pause`."""
        if self.running:
            assert self._proc is not None
            self._proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        """A clean shutdown (SIGTERM, then SIGKILL after 5 s)."""
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.send_signal(signal.SIGCONT)  # a paused server cannot exit
                self._proc.terminate()
                try:
                    self._proc.wait(5)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
                    self._proc.wait()
            self._proc = None

    def close(self) -> None:
        """Stop the server and remove its directory."""
        self.stop()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> LocalRedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # last resort: never leave a server behind
        with contextlib.suppress(Exception):
            if self._proc is not None and self._proc.poll() is None:
                self._proc.kill()
        with contextlib.suppress(Exception):
            if os.path.isdir(self._dir):
                shutil.rmtree(self._dir, ignore_errors=True)
