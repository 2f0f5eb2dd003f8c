"""The store interface the remote tier needs, and its Redis/Valkey implementation.

A backend is four batched calls on opaque byte keys and values; everything hostkv-specific
(keys, value format, checks, threads, breaker) lives above it, so another store (Mooncake
Store, a file system) needs only these. Every call either returns or raises RemoteError
within the configured timeouts; none may block forever.

redis-py is imported here only, when a Redis backend is built: ``import hostkv`` (and
``import hostkv.remote``) work without it.
"""

from __future__ import annotations

import abc
import contextlib
import threading
import time
from typing import Any, Dict, Generator, Iterator, List, Optional, Sequence, Set, Tuple

from hostkv.errors import ConfigError, HostKVError
from hostkv.remote.config import RemoteConfig

__all__ = ["UNAVAILABLE", "RedisBackend", "RemoteBackend", "RemoteError", "RemoteFullError",
           "backend_for"]


class RemoteError(HostKVError):
    """The remote store failed: unreachable, timed out, refused, or answered nonsense.

    The tier counts it and carries on from host memory; it never reaches the engine from
    the background paths. The message names the server with its password masked.
    """


class RemoteFullError(RemoteError):
    """The store answered but refused to store (out of memory, read-only replica): it is
    up, so reads go on; the refused writes are dropped."""


class _Unavailable:
    """The type of UNAVAILABLE."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "UNAVAILABLE"

    def __reduce__(self) -> str:
        return "UNAVAILABLE"


#: What a backend returns for a key whose server did not answer while others did (a dead
#: cluster node, one backing off after failing, a slot nobody serves): neither a value nor
#: a miss. The tier's chain of pages stops there, and it counts an error.
UNAVAILABLE: Any = _Unavailable()


class RemoteBackend(abc.ABC):
    """A key-value store under the host tier. Implementations must be thread-safe."""

    @abc.abstractmethod
    def get_many(self, keys: Sequence[bytes]) -> List[Optional[bytes]]:
        """The values of keys, None for a missing one, in one round trip (per server node).
        On a store of several nodes, a key whose node failed while others answered is
        UNAVAILABLE; RemoteError when none answered."""

    def get_streamed(self, groups: Sequence[Sequence[bytes]]) -> Iterator[List[Optional[bytes]]]:
        """The values of several groups of keys, group by group, in one round trip: a
        caller can check and copy one group while the next is still arriving (values as
        get_many's). The default fetches everything with get_many, then yields."""
        flat = self.get_many([key for group in groups for key in group])
        offset = 0
        for group in groups:
            yield flat[offset:offset + len(group)]
            offset += len(group)

    @abc.abstractmethod
    def put_many(self, items: Sequence[Tuple[bytes, bytes]], ttl_seconds: int) -> int:
        """Stores every (key, value), each atomically (a reader sees all of a value or none
        of it), expiring after ttl_seconds (0: never). Pipelined, not one round trip each.
        Returns how many were not stored because their node failed or refused while
        others stored theirs (0: all stored). Raises RemoteFullError when the store is up
        but refuses them all (full), RemoteError when it stored none for failing."""

    @abc.abstractmethod
    def touch_many(self, keys: Sequence[bytes], ttl_seconds: int) -> List[Optional[bool]]:
        """For each key, whether it exists (None: its node did not answer while others
        did); existing ones get their expiry renewed."""

    @abc.abstractmethod
    def ping(self) -> None:
        """Raises RemoteError unless the store answers."""

    @abc.abstractmethod
    def close(self) -> None:
        """Drops connections. Idempotent."""


class RedisBackend(RemoteBackend):
    """Redis or Valkey through redis-py (hiredis parses when installed): a single node or a
    cluster, as the config's URL says.

    On a cluster the keys of one call spread over the nodes by hash slot; each node gets
    its commands in one pipeline, written to every node before any reply is read. The
    cluster client is built on first use (redis-py's connects to the seeds at once), so an
    unreachable cluster is a counted RemoteError on a call, never an error at startup.

    A cluster node that fails (refused, reset, timed out) fails only its own keys: they
    come back UNAVAILABLE while the other nodes' answers stand, and a call raises only
    when every master has failed (the store is down). The failed node is then left alone
    for the config's backoff (doubling up to backoff_max, one probe call when it ends):
    its keys are UNAVAILABLE at once, so a dead or stopped node costs the calls nothing,
    not a timeout each. The slot map is refreshed when a node fails or answers
    MOVED/ASK/CLUSTERDOWN, so a replica promoted in its place is found.
    """

    def __init__(self, config: RemoteConfig) -> None:
        """Builds the client (connects lazily, on the first call).

        Raises:
            ConfigError: redis-py is not installed.
        """
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError:
            raise ConfigError("the Redis remote tier needs redis-py: "
                              "pip install 'hostkv[remote]'") from None
        self._redis = redis
        self._config = config
        self._where = config.redacted_url
        parsed = config.parsed
        common: dict = dict(
            username=parsed.username, password=parsed.password,
            socket_timeout=config.socket_timeout,
            socket_connect_timeout=config.connect_timeout,
            # The tier retries on its own terms (breaker, backoff); redis-py's own retries
            # would multiply the worst-case wait.
            retry=Retry(NoBackoff(), 0),
            # Pages are tens of KiB to MiB: read the socket in 1 MiB gulps, not redis-py's
            # 64 KiB (a third fewer recv calls and parser passes on a fetch).
            socket_read_size=1 << 20,
        )
        if parsed.tls:
            common["ssl"] = True
            common.update(parsed.tls_options)
        self._lock = threading.Lock()
        self._cluster_client: Any = None
        # Cluster nodes that failed: name -> (time of the next probe, current backoff).
        self._down: Dict[str, Tuple[float, float]] = {}
        if parsed.cluster:
            from redis.cluster import ClusterNode, RedisCluster
            self._cluster = True
            self._make_cluster = lambda: RedisCluster(
                startup_nodes=[ClusterNode(host, port) for host, port in parsed.nodes],
                # A dead node must fail its own keys, not every call.
                require_full_coverage=False,
                **common)
        else:
            self._cluster = False
            if parsed.path is not None:
                common.pop("ssl", None)
                self._single = redis.Redis(unix_socket_path=parsed.path, db=parsed.db, **common)
            else:
                host, port = parsed.nodes[0]
                self._single = redis.Redis(host=host, port=port, db=parsed.db, **common)

    @property
    def _client(self) -> Any:
        """The redis-py client; a cluster's is made on first use (RemoteError if no seed
        answers)."""
        if not self._cluster:
            return self._single
        with self._lock:
            if self._cluster_client is None:
                try:
                    self._cluster_client = self._make_cluster()
                except (self._redis.RedisError,
                        self._redis.exceptions.RedisClusterException) as exc:
                    # No seed answers: RedisClusterException, which is not a RedisError.
                    raise self._fail(exc, "connect to the cluster") from None
            return self._cluster_client

    def _fail(self, exc: BaseException, what: str) -> RemoteError:
        # redis-py's messages name host:port at most; say which server by its redacted URL.
        return RemoteError(f"{what} on {self._where}: {type(exc).__name__}: {exc}")

    def get_many(self, keys: Sequence[bytes]) -> List[Optional[bytes]]:
        """One MGET (single node) or one pipeline per node (cluster)."""
        if not keys:
            return []
        if self._cluster:
            out: List[Optional[bytes]] = []
            for values in self._cluster_streamed([keys]):
                out = values
            return out
        try:
            return list(self._client.mget(list(keys)))
        except self._redis.RedisError as exc:
            raise self._fail(exc, f"MGET of {len(keys)} keys") from None

    def get_streamed(self, groups: Sequence[Sequence[bytes]]) -> Iterator[List[Optional[bytes]]]:
        """One MGET per group, all sent at once (one round trip), each reply handed over as
        soon as it is parsed. On a cluster: a pipeline per node (see _cluster_calls)."""
        if self._cluster:
            yield from self._cluster_streamed(groups)
            return
        if len(groups) < 2:
            yield from super().get_streamed(groups)
            return
        redis = self._redis
        pool = self._client.connection_pool
        try:
            try:
                conn = pool.get_connection()
            except TypeError:                       # redis-py < 5.3 wants a command name
                conn = pool.get_connection("MGET")
        except redis.RedisError as exc:
            raise self._fail(exc, "connect") from None
        unread = len(groups)
        try:
            try:
                conn.send_packed_command(conn.pack_commands(
                    [("MGET", *group) for group in groups if group]))
                unread = sum(1 for group in groups if group)
            except redis.RedisError as exc:
                raise self._fail(exc, f"MGET of {len(groups)} groups") from None
            for group in groups:
                if not group:
                    yield []
                    continue
                try:
                    reply = conn.read_response()
                except redis.RedisError as exc:
                    raise self._fail(exc, f"MGET of {len(group)} keys") from None
                unread -= 1
                if isinstance(reply, redis.ResponseError) or not isinstance(reply, list) \
                        or len(reply) != len(group):
                    raise RemoteError(f"MGET on {self._where}: unexpected reply")
                yield reply
        finally:
            if unread:
                # Replies left unread (an error, or the caller stopped): the connection's
                # stream is out of step, so it must not go back into the pool as it is.
                conn.disconnect()
            pool.release(conn)

    def _cluster_streamed(self, groups: Sequence[Sequence[bytes]]
                          ) -> Iterator[List[Optional[bytes]]]:
        """A GET per key, on the node owning it (see _cluster_calls); a refused GET (MOVED,
        CLUSTERDOWN, ...) is UNAVAILABLE like a failed node's."""
        calls = self._cluster_calls([[(key, ("GET", key)) for key in group] for group in groups],
                                    "GET")
        error = self._redis.ResponseError
        try:
            for replies in calls:
                yield [UNAVAILABLE if isinstance(r, error) else r for r in replies]
        finally:
            calls.close()

    # -- cluster nodes that fail ---------------------------------------------------------------

    def _may_contact(self, name: str) -> bool:
        """False while a failed node backs off; once its backoff ends, True for one call
        (the probe; the others go on skipping it until its outcome)."""
        with self._lock:
            entry = self._down.get(name)
            if entry is None:
                return True
            probe_at, backoff = entry
            now = time.monotonic()
            if now < probe_at:
                return False
            self._down[name] = (now + backoff, backoff)
            return True

    def _node_failed(self, name: str) -> None:
        cfg = self._config
        with self._lock:
            entry = self._down.get(name)
            backoff = cfg.backoff_initial if entry is None else min(
                max(entry[1] * 2, cfg.backoff_initial), cfg.backoff_max)
            self._down[name] = (time.monotonic() + backoff, backoff)

    def _node_answered(self, name: str) -> None:
        if self._down:
            with self._lock:
                self._down.pop(name, None)

    def _every_master_down(self, client: Any) -> bool:
        """Whether every master the slot map names has failed (and not answered since)."""
        try:
            masters = [node.name for node in list(client.nodes_manager.nodes_cache.values())
                       if node.server_type == "primary"]
        except Exception:      # a slot map being rebuilt by another thread: assume down
            return True
        with self._lock:
            return all(name in self._down for name in masters)

    def _cluster_calls(self, groups: Sequence[Sequence[Tuple[bytes, tuple]]], what: str
                       ) -> Generator[List[Any], None, None]:
        """Runs (key, command) pairs on the nodes owning the keys: each node's commands in
        one write, every node's sent before any reply is read; yields each group's replies
        in order (each node's in the order sent).

        A reply is the server's answer, a ResponseError instance (that command refused),
        or UNAVAILABLE (no node serves its slot, its node is backing off after failing, or
        failed during this call). Raises RemoteError only when a node failed, none
        answered anything, and every master has failed: the store is down. One dead
        master among live ones never raises (its keys are UNAVAILABLE), so it cannot open
        the caller's circuit breaker, however its keys fall in the calls.
        """
        redis = self._redis
        client = self._client
        per_node: Dict[str, Tuple[Any, List[tuple]]] = {}
        owners: List[List[Optional[str]]] = []      # per group, per command: its node
        for group in groups:
            names: List[Optional[str]] = []
            for key, command in group:
                try:
                    node = client.nodes_manager.get_node_from_slot(client.keyslot(key))
                except (redis.RedisError, redis.exceptions.RedisClusterException):
                    names.append(None)                # a slot nobody serves now
                    continue
                per_node.setdefault(node.name, (node, []))[1].append(command)
                names.append(node.name)
            owners.append(names)
        conns: Dict[str, Tuple[Any, Any]] = {}
        unread: Dict[str, int] = {}
        lost: Set[str] = set()                        # skipped, or failed in this call
        failure: Optional[BaseException] = None
        answered = refresh = False
        try:
            for name, (node, commands) in per_node.items():
                if not self._may_contact(name):
                    lost.add(name)
                    continue
                try:
                    pool = client.get_redis_connection(node).connection_pool
                    try:
                        conn = pool.get_connection()
                    except TypeError:                   # redis-py < 5.3
                        conn = pool.get_connection(commands[0][0])
                    conns[name] = (pool, conn)
                    unread[name] = len(commands)
                    conn.send_packed_command(conn.pack_commands(commands))
                except redis.RedisError as exc:
                    lost.add(name)
                    failure = exc
                    self._node_failed(name)
            for names in owners:
                replies: List[Any] = []
                for owner in names:
                    if owner is None or owner in lost:
                        replies.append(UNAVAILABLE)
                        continue
                    name = owner
                    conn = conns[name][1]
                    try:
                        reply = conn.read_response()
                    except redis.ResponseError as exc:
                        # MOVED, ASK, CLUSTERDOWN: the slot map changed; refresh it after.
                        reply = exc
                        refresh = refresh or isinstance(
                            exc, (redis.exceptions.ClusterError, redis.exceptions.MovedError,
                                  redis.exceptions.AskError, redis.exceptions.TryAgainError))
                    except redis.RedisError as exc:
                        lost.add(name)
                        failure = exc
                        self._node_failed(name)
                        replies.append(UNAVAILABLE)
                        continue
                    unread[name] -= 1
                    answered = True
                    replies.append(reply)
                yield replies
            for name in conns:
                if name not in lost:
                    self._node_answered(name)
            if lost and not answered and self._every_master_down(client):
                # The store is down, not just a node of it (every master failed, or still
                # backs off since it did): the caller's breaker counts it.
                raise self._fail(failure or ConnectionError("every master is backing off"),
                                 f"{what} of {sum(map(len, groups))} keys")
        finally:
            for name, (pool, conn) in conns.items():
                if unread[name]:
                    conn.disconnect()           # out of step: never reuse it as it is
                pool.release(conn)
            if refresh or failure is not None:
                # A failed node may have been replaced by its replica: ask the cluster.
                with contextlib.suppress(Exception):
                    client.nodes_manager.initialize()

    def put_many(self, items: Sequence[Tuple[bytes, bytes]], ttl_seconds: int) -> int:
        """One pipeline of SETs (SET is atomic: a reader never sees half a value); on a
        cluster, one per node (see _cluster_calls)."""
        if not items:
            return 0
        if self._cluster:
            tail: tuple = ("EX", ttl_seconds) if ttl_seconds else ()
            replies = self._cluster_all([(k, ("SET", k, v) + tail) for k, v in items], "SET")
            refused = [r for r in replies if isinstance(r, self._redis.ResponseError)]
            stored = sum(1 for r in replies if r is not UNAVAILABLE and not
                         isinstance(r, Exception))
            if not stored and refused:
                raise RemoteFullError(f"SET of {len(items)} values on {self._where}: "
                                      f"refused: {refused[0]}")
            return len(items) - stored
        try:
            pipe = self._client.pipeline(transaction=False)
            for key, value in items:
                pipe.set(key, value, ex=ttl_seconds or None)
            results = pipe.execute(raise_on_error=True)
        except self._redis.ResponseError as exc:
            raise RemoteFullError(f"SET of {len(items)} values on {self._where}: "
                                  f"refused: {exc}") from None
        except self._redis.RedisError as exc:
            raise self._fail(exc, f"SET of {len(items)} values") from None
        if not all(results):
            raise RemoteError(f"SET of {len(items)} values on {self._where}: refused")
        return 0

    def touch_many(self, keys: Sequence[bytes], ttl_seconds: int) -> List[Optional[bool]]:
        """One pipeline of EXPIRE (or EXISTS when values never expire); on a cluster, one
        per node."""
        if not keys:
            return []
        if self._cluster:
            replies = self._cluster_all(
                [(k, ("EXPIRE", k, ttl_seconds) if ttl_seconds else ("EXISTS", k))
                 for k in keys], "EXPIRE")
            return [None if r is UNAVAILABLE or isinstance(r, Exception) else bool(r)
                    for r in replies]
        try:
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                if ttl_seconds:
                    pipe.expire(key, ttl_seconds)
                else:
                    pipe.exists(key)
            return [bool(r) for r in pipe.execute(raise_on_error=True)]
        except self._redis.RedisError as exc:
            raise self._fail(exc, f"EXPIRE of {len(keys)} keys") from None

    def _cluster_all(self, calls: List[Tuple[bytes, tuple]], what: str) -> List[Any]:
        """_cluster_calls for one group, run to its end."""
        out: List[Any] = []
        for replies in self._cluster_calls([calls], what):
            out = replies
        return out

    def ping(self) -> None:
        """PING (every node of a cluster)."""
        try:
            self._client.ping()
        except self._redis.RedisError as exc:
            raise self._fail(exc, "PING") from None

    def close(self) -> None:
        """Closes the client's connections."""
        client = self._single if not self._cluster else self._cluster_client
        if client is None:
            return
        try:
            client.close()
        except Exception:   # closing a broken connection may raise; it is closed either way
            pass

    def __repr__(self) -> str:
        return f"<RedisBackend {self._where}>"


def backend_for(config: RemoteConfig) -> RemoteBackend:
    """The backend the config's URL names (today: Redis/Valkey for every scheme)."""
    return RedisBackend(config)
