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
from typing import Any, Iterator, List, Optional, Sequence, Tuple

from hostkv.errors import ConfigError, HostKVError
from hostkv.remote.config import RemoteConfig

__all__ = ["RedisBackend", "RemoteBackend", "RemoteError", "RemoteFullError", "backend_for"]


class RemoteError(HostKVError):
    """The remote store failed: unreachable, timed out, refused, or answered nonsense.

    The tier counts it and carries on from host memory; it never reaches the engine from
    the background paths. The message names the server with its password masked.
    """


class RemoteFullError(RemoteError):
    """The store answered but refused to store (out of memory, read-only replica): it is
    up, so reads go on; the refused writes are dropped."""


class RemoteBackend(abc.ABC):
    """A key-value store under the host tier. Implementations must be thread-safe."""

    @abc.abstractmethod
    def get_many(self, keys: Sequence[bytes]) -> List[Optional[bytes]]:
        """The values of keys, None for a missing one, in one round trip (per server node)."""

    def get_streamed(self, groups: Sequence[Sequence[bytes]]) -> Iterator[List[Optional[bytes]]]:
        """The values of several groups of keys, group by group, in one round trip: a
        caller can check and copy one group while the next is still arriving. The default
        fetches everything with get_many, then yields."""
        flat = self.get_many([key for group in groups for key in group])
        offset = 0
        for group in groups:
            yield flat[offset:offset + len(group)]
            offset += len(group)

    @abc.abstractmethod
    def put_many(self, items: Sequence[Tuple[bytes, bytes]], ttl_seconds: int) -> None:
        """Stores every (key, value), each atomically (a reader sees all of a value or none
        of it), expiring after ttl_seconds (0: never). Pipelined, not one round trip each.
        Raises RemoteFullError when the store is up but refuses (full)."""

    @abc.abstractmethod
    def touch_many(self, keys: Sequence[bytes], ttl_seconds: int) -> List[bool]:
        """For each key, whether it exists; existing ones get their expiry renewed."""

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
                except self._redis.RedisError as exc:
                    raise self._fail(exc, "connect to the cluster") from None
            return self._cluster_client

    def _fail(self, exc: BaseException, what: str) -> RemoteError:
        # redis-py's messages name host:port at most; say which server by its redacted URL.
        return RemoteError(f"{what} on {self._where}: {type(exc).__name__}: {exc}")

    def get_many(self, keys: Sequence[bytes]) -> List[Optional[bytes]]:
        """One MGET (single node) or one pipeline per node (cluster)."""
        if not keys:
            return []
        try:
            if self._cluster:
                return list(self._client.mget_nonatomic(list(keys)))
            return list(self._client.mget(list(keys)))
        except self._redis.RedisError as exc:
            raise self._fail(exc, f"MGET of {len(keys)} keys") from None

    def get_streamed(self, groups: Sequence[Sequence[bytes]]) -> Iterator[List[Optional[bytes]]]:
        """One MGET per group, all sent at once (one round trip), each reply handed over as
        soon as it is parsed. On a cluster: get_many's per-node pipelines, then yields."""
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
        """A GET per key, each node's sent in one write, every node's before any reply is
        read; then the replies are read group by group (each node's in the order sent)."""
        redis = self._redis
        client = self._client
        per_node: dict = {}          # node name -> (node, [keys in send order])
        owners = []                  # per group, per key: its node's name
        try:
            for group in groups:
                names = []
                for key in group:
                    node = client.nodes_manager.get_node_from_slot(client.keyslot(key))
                    per_node.setdefault(node.name, (node, []))[1].append(key)
                    names.append(node.name)
                owners.append(names)
        except redis.RedisError as exc:
            raise self._fail(exc, "route keys") from None
        conns: dict = {}
        unread = {name: len(keys) for name, (_, keys) in per_node.items()}
        try:
            try:
                for name, (node, keys) in per_node.items():
                    pool = client.get_redis_connection(node).connection_pool
                    try:
                        conn = pool.get_connection()
                    except TypeError:                   # redis-py < 5.3
                        conn = pool.get_connection("GET")
                    conns[name] = (pool, conn)
                    conn.send_packed_command(conn.pack_commands([("GET", k) for k in keys]))
            except redis.RedisError as exc:
                raise self._fail(exc, f"GET of {sum(map(len, groups))} keys") from None
            for group, names in zip(groups, owners):
                values = []
                for key, name in zip(group, names):
                    try:
                        values.append(conns[name][1].read_response())
                    except redis.ResponseError as exc:
                        # MOVED, ASK, CLUSTERDOWN: the slot map changed; refresh it for
                        # the next call, and fail this one.
                        unread[name] -= 1
                        with contextlib.suppress(Exception):
                            client.nodes_manager.initialize()
                        raise self._fail(exc, "GET") from None
                    except redis.RedisError as exc:
                        raise self._fail(exc, "GET") from None
                    unread[name] -= 1
                yield values
        finally:
            for name, (pool, conn) in conns.items():
                if unread[name]:
                    conn.disconnect()           # out of step: never reuse it as it is
                pool.release(conn)

    def put_many(self, items: Sequence[Tuple[bytes, bytes]], ttl_seconds: int) -> None:
        """One pipeline of SETs (SET is atomic: a reader never sees half a value)."""
        if not items:
            return
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

    def touch_many(self, keys: Sequence[bytes], ttl_seconds: int) -> List[bool]:
        """One pipeline of EXPIRE (or EXISTS when values never expire)."""
        if not keys:
            return []
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
