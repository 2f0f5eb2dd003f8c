"""Real redis-server processes for the remote tier's tests: a single node and a 3-master
cluster on 127.0.0.1 at free ports, each in its own temporary directory, always stopped
(SIGCONT first: a SIGSTOPped server cannot die otherwise), failures included.

redis-server and redis-cli come from Debian's redis-server/redis-tools packages
(scripts/test.sh installs them when missing); nothing is started globally.
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
from typing import Iterator, List

import pytest

SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"
CLI = shutil.which("redis-cli") or "/usr/bin/redis-cli"
START_TIMEOUT = 20.0


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port(cluster: bool = False) -> int:
    """A TCP port nobody listens on now (the server binds it a moment later). A cluster
    node also binds port + 10000 for its bus, so its port must be at most 55535."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if not cluster:
            return port
        if port > 55535:
            port = 20000 + port % 30000
        if _bindable(port) and _bindable(port + 10000):
            return port


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


class TLSFiles:
    """A throwaway CA and a server certificate for 127.0.0.1 (openssl, in `directory`)."""

    def __init__(self, directory: str) -> None:
        self.ca = os.path.join(directory, "ca.crt")
        self.cert = os.path.join(directory, "server.crt")
        self.key = os.path.join(directory, "server.key")
        ca_key = os.path.join(directory, "ca.key")
        csr = os.path.join(directory, "server.csr")
        ext = os.path.join(directory, "ext.cnf")
        with open(ext, "w") as f:
            f.write("subjectAltName=IP:127.0.0.1\n")

        def openssl(*args: str) -> None:
            subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)

        openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", ca_key, "-out",
                self.ca, "-days", "1", "-subj", "/CN=hostkv-test-ca")
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", self.key, "-out", csr,
                "-subj", "/CN=127.0.0.1")
        openssl("x509", "-req", "-in", csr, "-CA", self.ca, "-CAkey", ca_key,
                "-CAcreateserial", "-out", self.cert, "-days", "1", "-extfile", ext)


class RedisServer:
    """One redis-server process (start() / stop() / kill() / pause() / resume())."""

    def __init__(self, directory: str, port: int = 0, cluster: bool = False,
                 tls: "TLSFiles | None" = None, extra: "tuple[str, ...]" = ()) -> None:
        self.port = port or free_port(cluster)
        self.cluster = cluster
        self.tls = tls
        self.extra = tuple(extra)           # more redis-server arguments
        self.directory = os.path.join(directory, str(self.port))
        os.makedirs(self.directory, exist_ok=True)
        self.process: "subprocess.Popen[bytes] | None" = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "RedisServer":
        args = [SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", self.directory, "--daemonize", "no",
                "--protected-mode", "no", "--logfile", os.path.join(self.directory, "log")]
        if self.tls is not None:
            args[1:3] = ["--port", "0", "--tls-port", str(self.port)]
            args += ["--tls-cert-file", self.tls.cert, "--tls-key-file", self.tls.key,
                     "--tls-ca-cert-file", self.tls.ca, "--tls-auth-clients", "no"]
        if self.cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file",
                     os.path.join(self.directory, "nodes.conf"), "--cluster-node-timeout", "1000"]
        args += list(self.extra)
        self.process = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + START_TIMEOUT
        while not (_accepts(self.port) if self.tls else _answers(self.port)):
            if self.process.poll() is not None or time.monotonic() > deadline:
                log = self.log()
                self.stop()
                raise RuntimeError(f"redis-server on port {self.port} did not start:\n{log}")
            time.sleep(0.02)
        return self

    def log(self) -> str:
        with contextlib.suppress(OSError), open(os.path.join(self.directory, "log")) as f:
            return f.read()[-4000:]
        return ""

    def cli(self, *args: str, timeout: float = 10.0) -> str:
        """redis-cli against this server; returns its output."""
        out = subprocess.run([CLI, "-h", "127.0.0.1", "-p", str(self.port), *args],
                             capture_output=True, text=True, timeout=timeout)
        return out.stdout

    def pause(self) -> None:
        """SIGSTOP: the server holds its connections and answers nothing."""
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL, as a crash; the data (in memory only) is gone."""
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.process.pid, signal.SIGCONT)
                self.process.kill()
            self.process.wait(10)

    def stop(self) -> None:
        self.kill()
        self.process = None


@contextlib.contextmanager
def redis_single() -> Iterator[RedisServer]:
    """A running single-node server, stopped on exit."""
    directory = tempfile.mkdtemp(prefix="hostkv-redis-")
    server = RedisServer(directory)
    try:
        yield server.start()
    finally:
        server.stop()
        shutil.rmtree(directory, ignore_errors=True)


class RedisCluster:
    """Three masters, no replicas, all 16384 slots covered."""

    def __init__(self, servers: List[RedisServer]) -> None:
        self.servers = servers

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{s.port}" for s in self.servers)


@contextlib.contextmanager
def redis_cluster(full_coverage: bool = True) -> Iterator[RedisCluster]:
    """A running 3-master cluster, stopped on exit. full_coverage=False: the masters keep
    serving their slots while another is down (cluster-require-full-coverage no)."""
    directory = tempfile.mkdtemp(prefix="hostkv-redis-cluster-")
    extra = () if full_coverage else ("--cluster-require-full-coverage", "no")
    servers = [RedisServer(directory, cluster=True, extra=extra) for _ in range(3)]
    try:
        for server in servers:
            server.start()
        out = subprocess.run(
            [CLI, "--cluster", "create", *[f"127.0.0.1:{s.port}" for s in servers],
             "--cluster-replicas", "0", "--cluster-yes"],
            capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed:\n{out.stdout}\n{out.stderr}")
        deadline = time.monotonic() + START_TIMEOUT
        while not all("cluster_state:ok" in s.cli("cluster", "info") for s in servers):
            if time.monotonic() > deadline:
                raise RuntimeError("the cluster did not reach cluster_state:ok")
            time.sleep(0.05)
        yield RedisCluster(servers)
    finally:
        for server in servers:
            server.stop()
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def redis_server():
    """A single-node redis-server for one test."""
    with redis_single() as server:
        yield server


@pytest.fixture(scope="module")
def redis_cluster_module():
    """A 3-master cluster shared by one module's tests (creating one takes ~a second)."""
    with redis_cluster() as cluster:
        yield cluster
