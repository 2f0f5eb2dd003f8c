"""RemoteConfig: where the remote tier lives and how hard it may push, parsed from a URL.

URLs follow redis-py's ``Redis.from_url`` for a single node and add a cluster form:

    redis://[[user]:password@]host[:port][/db]           a single node (port 6379, db 0)
    rediss://...                                          the same over TLS
    unix://[[user]:password@]/path/to/socket[?db=N]       a local socket
    redis+cluster://[[user]:password@]h1:p1,h2:p2[,...]   a Redis Cluster, any nodes as seeds
    rediss+cluster://...                                  the same over TLS

TLS options come from the query string as in redis-py (``ssl_ca_certs``, ``ssl_certfile``,
``ssl_keyfile``, ``ssl_cert_reqs``, ``ssl_check_hostname``); the password may be percent-encoded.
A bad URL or value is a :class:`~hostkv.errors.ConfigError` naming it, before any connection.
The password never appears in ``repr``, ``str``, log lines or error messages: every one of
them uses :attr:`RemoteConfig.redacted_url`.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Dict, List, Optional, Tuple
from urllib.parse import parse_qsl, unquote, urlsplit

from hostkv._validate import number
from hostkv.errors import ConfigError

__all__ = ["ParsedURL", "RemoteConfig", "WRITE_POLICIES", "parse_url"]

WRITE_POLICIES = ("through", "evict")

_SCHEMES = ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster")
_TLS_OPTIONS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs",
                "ssl_check_hostname", "ssl_ca_path")
_HOST_RE = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+)$")
# Key prefixes become part of every key: printable, no spaces, short enough to leave room.
_PREFIX_RE = re.compile(r"^[A-Za-z0-9._:/{}-]{1,64}$")


@dataclasses.dataclass(frozen=True)
class ParsedURL:
    """A validated remote URL, split into what a client needs.

    Attributes:
        scheme: One of redis, rediss, unix, redis+cluster, rediss+cluster.
        nodes: (host, port) pairs: one for a single node, the seeds of a cluster, none for unix.
        path: The socket path of a unix URL.
        db: The database number (0 for a cluster).
        username, password: Credentials, or None.
        tls: True for rediss schemes.
        tls_options: The ssl_* query options, as redis-py takes them.
    """

    scheme: str
    nodes: Tuple[Tuple[str, int], ...]
    path: Optional[str]
    db: int
    username: Optional[str]
    password: Optional[str] = dataclasses.field(repr=False)
    tls: bool
    tls_options: Dict[str, Any]

    @property
    def cluster(self) -> bool:
        """True for a Redis Cluster URL."""
        return self.scheme.endswith("+cluster")


def _port(text: str, url_for_errors: str) -> int:
    if not text.isdigit():
        raise ConfigError(f"remote URL {url_for_errors}: port must be a number, got {text!r}")
    port = int(text)
    if not 0 < port < 65536:
        raise ConfigError(f"remote URL {url_for_errors}: port must be in 1..65535, got {port}")
    return port


def _redact(url: str) -> str:
    """The URL with any password replaced by ***, for messages (never fails)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return "<not a URL>"
    netloc, slash, tail = rest.partition("/")
    if "@" in netloc:
        userinfo, _, hosts = netloc.rpartition("@")
        user = userinfo.split(":", 1)[0]
        netloc = f"{user}:***@{hosts}" if ":" in userinfo else f"{user}@{hosts}"
    tail, _, query = (slash + tail).partition("?")
    if query:
        # A password may also come as ?password=...
        parts = ["password=***" if p.lower().startswith("password=") else p
                 for p in query.split("&")]
        tail += "?" + "&".join(parts)
    return f"{scheme}://{netloc}{tail}"


def parse_url(url: Any) -> ParsedURL:
    """Validates a remote URL and splits it.

    Raises:
        ConfigError: not a string, an unknown scheme, no host, a bad port or db, an unknown
            query option, or a db other than 0 for a cluster. The message shows the URL with
            its password masked.
    """
    if not isinstance(url, str):
        raise ConfigError(f"remote URL must be a string, got {type(url).__name__}")
    shown = _redact(url)
    if not url or any(c.isspace() for c in url):
        raise ConfigError(f"remote URL must be non-empty and without spaces, got {shown!r}")
    scheme, sep, rest = url.partition("://")
    scheme = scheme.lower()
    if not sep or scheme not in _SCHEMES:
        raise ConfigError(
            f"remote URL {shown}: the scheme must be one of {', '.join(s + '://' for s in _SCHEMES)}")
    if scheme == "unix":
        # urlsplit would read the path's first component as a host.
        netloc, _, path_query = rest.partition("/")
        path, _, query = ("/" + path_query).partition("?")
        hosts_text = ""
    else:
        try:
            split = urlsplit("x://" + rest)
        except ValueError as exc:           # e.g. an unclosed IPv6 bracket
            raise ConfigError(f"remote URL {shown}: {exc}") from None
        if split.fragment:
            raise ConfigError(f"remote URL {shown}: a fragment (#...) is not allowed")
        netloc, path, query = split.netloc, split.path, split.query
    username = password = None
    if "@" in netloc:
        userinfo, _, hosts_text = netloc.rpartition("@")
        user, colon, secret = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if colon else None
        if not colon and user:
            # redis-py reads "redis://secret@host" as a password with no user name.
            username, password = None, unquote(user)
    elif scheme != "unix":
        hosts_text = netloc
    options: Dict[str, str] = {}
    for key, value in parse_qsl(query, keep_blank_values=True):
        if key in options:
            raise ConfigError(f"remote URL {shown}: option {key!r} is given twice")
        options[key] = value
    db_text = options.pop("db", None)
    if "password" in options:
        password = options.pop("password")
    if "username" in options:
        username = options.pop("username")
    tls_options: Dict[str, Any] = {}
    for key in list(options):
        if key in _TLS_OPTIONS:
            value = options.pop(key)
            if key == "ssl_check_hostname":
                if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                    raise ConfigError(f"remote URL {shown}: ssl_check_hostname must be true or "
                                      f"false, got {value!r}")
                tls_options[key] = value.lower() in ("true", "1", "yes")
            elif key == "ssl_cert_reqs":
                if value.lower() not in ("none", "optional", "required"):
                    raise ConfigError(f"remote URL {shown}: ssl_cert_reqs must be none, "
                                      f"optional or required, got {value!r}")
                tls_options[key] = value.lower()
            else:
                tls_options[key] = value
    if options:
        raise ConfigError(f"remote URL {shown}: unknown option(s) {sorted(options)}; known: db, "
                          f"username, password, {', '.join(_TLS_OPTIONS)}")
    tls = scheme.startswith("rediss")
    if tls_options and not tls:
        raise ConfigError(f"remote URL {shown}: ssl_* options need a rediss:// scheme")
    nodes: List[Tuple[str, int]] = []
    socket_path: Optional[str] = None
    if scheme == "unix":
        if path in ("", "/"):
            raise ConfigError(f"remote URL {shown}: a unix URL needs a socket path")
        socket_path = unquote(path)
    else:
        if not hosts_text:
            raise ConfigError(f"remote URL {shown}: no host")
        parts = hosts_text.split(",")
        if len(parts) > 1 and not scheme.endswith("+cluster"):
            raise ConfigError(f"remote URL {shown}: several hosts need a redis+cluster:// scheme")
        for part in parts:
            if part.startswith("["):
                host, bracket, port_text = part.partition("]")
                host += bracket
                port_text = port_text[1:] if port_text.startswith(":") else port_text
                if port_text == "" and part.endswith("]:"):
                    raise ConfigError(f"remote URL {shown}: empty port in {part!r}")
            else:
                host, colon, port_text = part.rpartition(":") if ":" in part else (part, "", "")
                if colon and port_text == "":
                    raise ConfigError(f"remote URL {shown}: empty port in {part!r}")
            if not host or not _HOST_RE.match(host):
                raise ConfigError(f"remote URL {shown}: bad host {host!r}")
            port = _port(port_text, shown) if port_text else 6379
            nodes.append((host.strip("[]"), port))
        path_db = path.strip("/")
        if path_db:
            if db_text is not None:
                raise ConfigError(f"remote URL {shown}: the db is given twice")
            db_text = path_db
    db = 0
    if db_text is not None:
        if not db_text.isdigit():
            raise ConfigError(f"remote URL {shown}: the db must be a number, got {db_text!r}")
        db = int(db_text)
        if db > 1_000_000:
            raise ConfigError(f"remote URL {shown}: db {db} is out of range")
    if scheme.endswith("+cluster") and db != 0:
        raise ConfigError(f"remote URL {shown}: a cluster has only db 0, got db {db}")
    return ParsedURL(scheme=scheme, nodes=tuple(nodes), path=socket_path, db=db,
                     username=username, password=password, tls=tls, tls_options=tls_options)


@dataclasses.dataclass(frozen=True, repr=False)
class RemoteConfig:
    """The remote tier's settings. Validated when built; a bad value is a ConfigError.

    Attributes:
        url: Where the store is (see the module docstring). Holds the password, if any:
            use redacted_url to show it.
        key_prefix: Put before every key, to share one server between deployments.
        ttl_seconds: Every value expires this long after it was last written or found by a
            writer (0: never; then the server's maxmemory policy must evict).
        max_bytes_in_flight: Bytes of page copies the writer may hold queued or sending;
            beyond it, writes are dropped (counted), never waited for.
        max_queue: Writes (sequences) and lookups that may wait; beyond it, dropped (counted).
        max_fetch_pages: Pages one lookup asks for at most (bounds a fetch's size and time).
        socket_timeout: Seconds any one server reply may take before it is an error.
        connect_timeout: Seconds a connection attempt may take.
        failure_threshold: Consecutive failures that open the circuit breaker.
        backoff_initial, backoff_max: Seconds the breaker stays open after opening, doubling
            on every failed retry up to backoff_max; one probe goes through when it ends.
        write_batch_pages: Pages the writer sends in one pipeline at most.
        write_policy: When pages go to the store. "through" (the default): when the host
            commits them (tier.commit/release), so a prefix is shared with other hosts as
            soon as this one computed it. "evict": only when eviction is about to take
            them (with the part of their chain the store lacks, so another host can reach
            them): less traffic, but a prefix this host keeps hot is never shared. See
            the README's figures.
        evict_headroom: With write_policy="evict", the fraction of the pool kept "safe to
            evict": the writer keeps the coldest (evict_headroom x num_pages - free pages)
            evictable pages written, so eviction finds them already sent. In (0, 1].
        evict_poll_seconds: With write_policy="evict", how often the writer looks at the
            pool between the engine's commits and releases (each look takes the segment's
            lock once, briefly).
    """

    url: str
    key_prefix: str = "hostkv"
    ttl_seconds: int = 86_400
    max_bytes_in_flight: int = 256 << 20
    max_queue: int = 1024
    max_fetch_pages: int = 4096
    socket_timeout: float = 1.0
    connect_timeout: float = 0.5
    failure_threshold: int = 3
    backoff_initial: float = 0.5
    backoff_max: float = 30.0
    write_batch_pages: int = 64
    write_policy: str = "through"
    evict_headroom: float = 0.125
    evict_poll_seconds: float = 0.05

    def __post_init__(self) -> None:
        parse_url(self.url)
        if not isinstance(self.key_prefix, str) or not _PREFIX_RE.match(self.key_prefix):
            raise ConfigError("key_prefix must be 1-64 characters of letters, digits and "
                              f"._:/{{}}-, got {self.key_prefix!r}")
        number(self.ttl_seconds, "ttl_seconds", 0, 10 * 365 * 86_400, True, ConfigError)
        number(self.max_bytes_in_flight, "max_bytes_in_flight", 1, 2**44, True, ConfigError)
        number(self.max_queue, "max_queue", 1, 1 << 24, True, ConfigError)
        number(self.max_fetch_pages, "max_fetch_pages", 1, 1 << 20, True, ConfigError)
        number(self.socket_timeout, "socket_timeout", 0.001, 600, False, ConfigError)
        number(self.connect_timeout, "connect_timeout", 0.001, 600, False, ConfigError)
        number(self.failure_threshold, "failure_threshold", 1, 1 << 20, True, ConfigError)
        number(self.backoff_initial, "backoff_initial", 0.0, 3600, False, ConfigError)
        number(self.backoff_max, "backoff_max", 0.0, 86_400, False, ConfigError)
        if self.backoff_max < self.backoff_initial:
            raise ConfigError(f"backoff_max ({self.backoff_max}) must be >= backoff_initial "
                              f"({self.backoff_initial})")
        number(self.write_batch_pages, "write_batch_pages", 1, 1 << 16, True, ConfigError)
        if not isinstance(self.write_policy, str) or self.write_policy not in WRITE_POLICIES:
            raise ConfigError(f"write_policy must be one of {', '.join(map(repr, WRITE_POLICIES))}, "
                              f"got {self.write_policy!r}")
        number(self.evict_headroom, "evict_headroom", 0.0, 1.0, False, ConfigError)
        if self.evict_headroom == 0:
            raise ConfigError("evict_headroom must be in (0, 1], got 0 (nothing would be "
                              "written before its eviction)")
        number(self.evict_poll_seconds, "evict_poll_seconds", 0.001, 60, False, ConfigError)

    @property
    def parsed(self) -> ParsedURL:
        """The URL, validated and split."""
        return parse_url(self.url)

    @property
    def redacted_url(self) -> str:
        """The URL with its password masked: safe for logs, repr and error messages."""
        return _redact(self.url)

    def __repr__(self) -> str:
        fields = ", ".join(
            f"{f.name}={self.redacted_url if f.name == 'url' else getattr(self, f.name)!r}"
            for f in dataclasses.fields(self))
        return f"RemoteConfig({fields})"

    __str__ = __repr__
