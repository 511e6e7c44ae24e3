"""The kvstore configuration: ONE registry of options, and how their values are resolved.

Owns: the option registry (`OPTIONS`: name, type, default, help), SIZE parsing and
formatting ("512MiB", "4GiB"), the per-user default paths, and `load_config`, which
layers the sources, lowest to highest precedence:

    built-in defaults  <  TOML file  <  KVSTORE_* environment variables  <  CLI flags

Every option `foo_bar` is settable as `foo_bar = ...` in the TOML file (top level),
as KVSTORE_FOO_BAR in the environment and as `--foo-bar` on `kvstore serve`. The TOML
file is `--config FILE`, else $KVSTORE_CONFIG, else $XDG_CONFIG_HOME/kvstore/config.toml
(~/.config/kvstore/config.toml) when it exists. `Config.sources` records where each
effective value came from; `kvstore config` prints both.
"""

from __future__ import annotations

import difflib
import hashlib
import math
import os
import re
import stat
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

from kvstore.errors import InvalidRequest
from kvstore.tiers.registry import TIERS

try:  # Python >= 3.11
    import tomllib as _toml
except ImportError:  # pragma: no cover - Python 3.10
    try:
        import tomli as _toml  # type: ignore[no-redef]
    except ImportError:
        _toml = None  # type: ignore[assignment]

ENV_PREFIX = "KVSTORE_"
CONFIG_ENV = "KVSTORE_CONFIG"
SOCKET_NAME = "kvstore.sock"
UNIX_PATH_MAX = 107  # sun_path is 108 bytes including the terminating NUL
EVICTION_POLICIES = ("cost", "lru")
LOG_LEVELS = ("debug", "info", "warning", "error")
GPU_AUTO_BYTES = 1 << 30  # gpu_capacity "auto": this much where CUDA is present, else 0


class ConfigError(InvalidRequest):
    """A configuration value, file or variable is invalid (the message names it and its source)."""


# ---------------------------------------------------------------------------- sizes

_UNITS = {
    "": 1, "b": 1,
    "k": 1 << 10, "kib": 1 << 10, "kb": 10**3,
    "m": 1 << 20, "mib": 1 << 20, "mb": 10**6,
    "g": 1 << 30, "gib": 1 << 30, "gb": 10**9,
    "t": 1 << 40, "tib": 1 << 40, "tb": 10**12,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: Any, what: str = "size") -> int:
    """Bytes from an int or a string like "512MiB", "4GiB", "1.5GiB", "100MB", "4096".

    Binary units: KiB MiB GiB TiB (and K M G T); decimal: KB MB GB TB. Raises ConfigError
    naming `what` and the bad value.
    """
    if isinstance(value, bool):
        raise ConfigError(f"{what}: expected a size such as 512MiB or 4GiB, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{what}: size must be >= 0, got {value}")
        return value
    if isinstance(value, float) and value.is_integer() and value >= 0:
        return int(value)
    if not isinstance(value, str):
        raise ConfigError(f"{what}: expected a size such as 512MiB or 4GiB, got {value!r}")
    m = _SIZE_RE.match(value)
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(
            f"{what}: invalid size {value!r}; expected a number and a unit such as 512MiB, 4GiB, "
            f"100MB or plain bytes (units: {', '.join(u for u in ('KiB', 'MiB', 'GiB', 'TiB', 'KB', 'MB', 'GB', 'TB'))})"
        )
    number, unit = float(m.group(1)), m.group(2).lower()
    size = number * _UNITS[unit]
    if not math.isfinite(size) or size > 1 << 62:
        raise ConfigError(f"{what}: size {value!r} is too large")
    return int(size)


def format_size(n: int) -> str:
    """A short human form: 1073741824 -> "1GiB", 1536 -> "1.5KiB", 100 -> "100B"."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            q = n / scale
            return f"{q:.0f}{unit}" if q.is_integer() else f"{q:.3g}{unit}"
    return f"{n}B"


# ---------------------------------------------------------------------------- defaults


def runtime_dir() -> Path:
    """The per-user runtime directory for the socket: $XDG_RUNTIME_DIR/kvstore, else
    /tmp/kvstore-$UID."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and Path(xdg).is_dir():
        return Path(xdg) / "kvstore"
    return Path("/tmp") / f"kvstore-{os.getuid()}"


def default_socket() -> Path:
    return runtime_dir() / SOCKET_NAME


def default_cache_dir() -> Path:
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "kvstore"


def default_config_file() -> Path:
    xdg = os.environ.get("XDG_CONFIG_HOME")
    base = Path(xdg) if xdg else Path.home() / ".config"
    return base / "kvstore" / "config.toml"


def shm_name_for(socket: Path) -> str:
    """A shared-memory arena name unique to (user, socket path): two daemons on two
    sockets never share an arena."""
    digest = hashlib.sha1(str(Path(socket).absolute()).encode()).hexdigest()[:10]
    return f"kvstore-{os.getuid()}-{digest}"


# ---------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class Option:
    """One configuration option. `kind` picks the parser: size, int, float, str, path,
    bool, choice, hostport, gpusize (a size or "auto")."""

    name: str
    kind: str
    default: Any  # a value, or a zero-argument callable computing it
    help: str
    choices: tuple[str, ...] = ()
    minimum: Optional[float] = None
    maximum: Optional[float] = None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    def default_value(self) -> Any:
        return self.default() if callable(self.default) else self.default


OPTIONS: tuple[Option, ...] = (
    Option("socket", "path", default_socket,
           "unix socket the daemon listens on (its directory is created with mode 0700, the socket 0600)"),
    Option("dir", "path", default_cache_dir, "cache directory: the NVMe tier's object files and the LMDB index"),
    Option("cpu_capacity", "size", 1 << 30, "bytes of the CPU tier's shared-memory arena (0: no CPU tier)"),
    Option("nvme_capacity", "size", 16 << 30, "bytes of object files the NVMe tier may keep under --dir (0: no NVMe tier)"),
    Option("gpu_capacity", "gpusize", "auto",
           f"bytes of the GPU tier's CUDA arena; auto: {format_size(GPU_AUTO_BYTES)} where CUDA is present, else 0"),
    Option("tcp", "hostport", "",
           "also listen on TCP HOST:PORT (empty: unix socket only; ':PORT' binds 127.0.0.1); needs a token file"),
    Option("tcp_token_file", "str", "",
           "file holding the bearer token every TCP request must carry (required with --tcp; clients take the "
           "same option)"),
    Option("tcp_tls_cert", "str", "", "PEM certificate chain: serve TCP over TLS (with --tcp-tls-key)"),
    Option("tcp_tls_key", "str", "", "PEM private key of --tcp-tls-cert"),
    Option("fast_lookup", "bool", True,
           "also answer Lookup on SOCKET.fast, a msgpack unix socket beside the gRPC one (mode 0600); "
           "clients use it when present, else gRPC"),
    Option("metrics_port", "int", 0, "serve Prometheus /metrics over HTTP on this port (0: off)", minimum=0),
    Option("metrics_host", "str", "127.0.0.1", "address the /metrics HTTP server binds"),
    Option("eviction", "choice", "cost", "eviction policy: cost (recompute cost per byte, with recency) or lru",
           choices=EVICTION_POLICIES),
    Option("default_tier", "choice", "cpu", "tier a put lands in when the client names none", choices=TIERS.names),
    Option("lease_ttl", "float", 30.0, "seconds a lease or reservation lives without a client keepalive", minimum=0.01),
    Option("expire_interval", "float", 1.0, "seconds between sweeps that expire dead leases and reservations",
           minimum=0.01),
    Option("verify_nvme", "choice", "always",
           "checksum NVMe objects on every get (always) or on the first get after a restart (first)",
           choices=("always", "first")),
    Option("writeback_on_close", "bool", False, "on shutdown, write CPU-tier objects back to the NVMe tier"),
    Option("writeback_watermark", "float", 0.5,
           "keep CPU-tier bytes without an NVMe copy at or below this share of the CPU tier, writing the coldest "
           "back in the background so making room never writes under the store's lock (1: off)",
           minimum=0.0, maximum=1.0),
    Option("verify_memory", "choice", "commit",
           "checksum CPU/GPU-tier objects once, at commit or first get (commit), or before every get (always: "
           "detects bytes changed in shared memory after commit, at the cost of hashing each read)",
           choices=("commit", "always")),
    Option("index_recovery", "choice", "rebuild",
           "a damaged LMDB index at start: rebuild it from the object files' headers (rebuild) or refuse to start "
           "naming `kvstore repair --dir DIR` (refuse)", choices=("rebuild", "refuse")),
    Option("arena_mode", "choice", "0600",
           "file mode of the shared-memory arena: 0600 (this user only), 0640 (the group may read), 0660 (the group "
           "may read and write)", choices=("0600", "0640", "0660")),
    Option("shm_name", "str", "", "name of the shared-memory arena (/dev/shm/NAME.<random>.arena); empty: derived from the socket"),
    Option("max_message_size", "size", 16 << 20, "largest gRPC message either end accepts", minimum=4096),
    Option("max_batch", "int", 4096, "most keys one batch request may carry", minimum=1),
    Option("max_key_bytes", "int", 511,
           "longest key accepted, in bytes (at most 511: the NVMe tier's LMDB index holds no longer key)",
           minimum=1, maximum=511),
    Option("workers", "int", 16, "threads for RPCs that block (the asyncio gRPC server runs the rest on its event loop)", minimum=1),
    Option("log_level", "choice", "info", "daemon log level", choices=LOG_LEVELS),
    Option("remote", "str", "",
           "remote tier shared by many hosts, e.g. mooncake://MASTER_HOST:PORT?metadata=URL&protocol=tcp (empty: none)"),
    Option("remote_policy", "str", "all", "which committed objects go to the remote tier: all | none | cost:SECONDS"),
    Option("remote_timeout", "float", 2.0, "seconds any remote operation may take before it counts as failed",
           minimum=0.001),
)
OPTIONS_BY_NAME: dict[str, Option] = {o.name: o for o in OPTIONS}


@dataclass(frozen=True)
class Config:
    """The effective configuration; `sources[name]` says where each value came from:
    "default", "file:PATH", "env:KVSTORE_X" or "flag:--x"."""

    socket: Path
    dir: Path
    cpu_capacity: int
    nvme_capacity: int
    gpu_capacity: Optional[int]  # None: "auto" (resolve with resolve_gpu_capacity)
    tcp: str
    tcp_token_file: str
    tcp_tls_cert: str
    tcp_tls_key: str
    fast_lookup: bool
    metrics_port: int
    metrics_host: str
    eviction: str
    default_tier: str
    lease_ttl: float
    expire_interval: float
    verify_nvme: str
    writeback_on_close: bool
    writeback_watermark: float
    verify_memory: str
    index_recovery: str
    arena_mode: str
    shm_name: str
    max_message_size: int
    max_batch: int
    max_key_bytes: int
    workers: int
    log_level: str
    remote: str = ""
    remote_policy: str = "all"
    remote_timeout: float = 2.0
    sources: dict[str, str] = field(default_factory=dict, compare=False)
    config_file: Optional[Path] = None

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready values (paths as strings, gpu_capacity None as "auto")."""
        out: dict[str, Any] = {}
        for o in OPTIONS:
            v = getattr(self, o.name)
            if isinstance(v, Path):
                v = str(v)
            if o.name == "gpu_capacity" and v is None:
                v = "auto"
            out[o.name] = v
        return out

    def display(self, name: str) -> str:
        """A value as a user would write it (sizes in binary units)."""
        o, v = OPTIONS_BY_NAME[name], getattr(self, name)
        if o.kind in ("size", "gpusize") and isinstance(v, int):
            return format_size(v)
        if v is None and o.kind == "gpusize":
            return "auto"
        if isinstance(v, bool):
            return "true" if v else "false"
        return str(v)

    def tcp_address(self) -> Optional[tuple[str, int]]:
        return parse_hostport(self.tcp, "tcp") if self.tcp else None


def parse_hostport(value: str, what: str = "tcp") -> tuple[str, int]:
    """("host", port) from "HOST:PORT" or "[v6]:PORT"; ConfigError naming the value. No
    host (":PORT") means the loopback address: listening on every interface takes an
    explicit "0.0.0.0:PORT"."""
    m = re.match(r"^\[(?P<h6>[^\]]+)\]:(?P<p6>\d+)$|^(?P<h>[^:\[\]]*):(?P<p>\d+)$", value.strip())
    if not m:
        raise ConfigError(f"{what}: expected HOST:PORT (e.g. 127.0.0.1:50051), got {value!r}")
    host = m.group("h6") or m.group("h") or "127.0.0.1"
    port = int(m.group("p6") or m.group("p"))
    if not 0 < port < 65536:
        raise ConfigError(f"{what}: port must be 1..65535, got {port} in {value!r}")
    return host, port


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _parse(option: Option, value: Any, source: str) -> Any:
    what = f"{option.name} (from {source})"
    kind = option.kind
    if kind == "size":
        out: Any = parse_size(value, what)
    elif kind == "gpusize":
        out = None if isinstance(value, str) and value.strip().lower() == "auto" else parse_size(value, what)
    elif kind == "int":
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise ConfigError(f"{what}: expected an integer, got {value!r}")
        try:
            out = int(value)
        except ValueError:
            raise ConfigError(f"{what}: expected an integer, got {value!r}") from None
    elif kind == "float":
        if isinstance(value, bool):
            raise ConfigError(f"{what}: expected a number, got {value!r}")
        try:
            out = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{what}: expected a number, got {value!r}") from None
        if not math.isfinite(out):
            raise ConfigError(f"{what}: expected a finite number, got {value!r}")
    elif kind == "bool":
        if isinstance(value, bool):
            out = value
        elif isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
            out = value.strip().lower() in _TRUE
        else:
            raise ConfigError(f"{what}: expected true or false, got {value!r}")
    elif kind == "path":
        if not isinstance(value, (str, Path)) or not str(value):
            raise ConfigError(f"{what}: expected a path, got {value!r}")
        out = Path(os.path.expandvars(str(value))).expanduser()
    elif kind == "choice":
        out = str(value).strip().lower()
        if out not in option.choices:
            raise ConfigError(f"{what}: {value!r} is not one of {', '.join(option.choices)}")
    elif kind == "hostport":
        out = str(value).strip()
        if out:
            parse_hostport(out, what)
    elif kind == "str":
        if not isinstance(value, str):
            raise ConfigError(f"{what}: expected a string, got {value!r}")
        out = value
    else:  # pragma: no cover - registry bug
        raise AssertionError(f"unknown option kind {kind!r}")
    if option.minimum is not None and isinstance(out, (int, float)) and out < option.minimum:
        raise ConfigError(f"{what}: must be >= {option.minimum:g}, got {value!r}")
    if option.maximum is not None and isinstance(out, (int, float)) and out > option.maximum:
        raise ConfigError(f"{what}: must be <= {option.maximum:g}, got {value!r}")
    return out


def _unknown(name: str, source: str) -> ConfigError:
    close = difflib.get_close_matches(name, list(OPTIONS_BY_NAME), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else f"; options: {', '.join(OPTIONS_BY_NAME)}"
    return ConfigError(f"unknown option {name!r} in {source}{hint}")


def read_toml(path: Path) -> dict[str, Any]:
    """The option table of a TOML config file (top-level keys, or a [kvstore] table)."""
    if _toml is None:  # pragma: no cover - Python 3.10 without tomli
        raise ConfigError(f"reading {path} needs Python >= 3.11 or the tomli package")
    try:
        with open(path, "rb") as fh:
            data = _toml.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    except _toml.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    if set(data) == {"kvstore"} and isinstance(data["kvstore"], dict):
        data = data["kvstore"]
    return data


def load_config(
    cli: Optional[Mapping[str, Any]] = None,
    config_file: Optional[Path | str] = None,
    env: Optional[Mapping[str, str]] = None,
) -> Config:
    """Resolve every option: defaults < TOML file < KVSTORE_* env < `cli` (name -> value;
    None values are ignored). `env` defaults to os.environ. Raises ConfigError naming the
    option, the bad value and where it came from."""
    env = os.environ if env is None else env
    cli = {k: v for k, v in (cli or {}).items() if v is not None}
    for name in cli:
        if name not in OPTIONS_BY_NAME:
            raise _unknown(name, "command-line flags")

    path: Optional[Path] = None
    if config_file is not None:
        path = Path(config_file).expanduser()
    elif env.get(CONFIG_ENV):
        path = Path(env[CONFIG_ENV]).expanduser()
    elif default_config_file().is_file():
        path = default_config_file()
    file_values = read_toml(path) if path is not None else {}
    for name in file_values:
        if name not in OPTIONS_BY_NAME:
            raise _unknown(name, f"config file {path}")

    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for o in OPTIONS:
        if o.name in cli:
            values[o.name], sources[o.name] = _parse(o, cli[o.name], o.flag), f"flag:{o.flag}"
        elif o.env in env:
            values[o.name], sources[o.name] = _parse(o, env[o.env], o.env), f"env:{o.env}"
        elif o.name in file_values:
            values[o.name], sources[o.name] = _parse(o, file_values[o.name], str(path)), f"file:{path}"
        else:
            values[o.name], sources[o.name] = _parse(o, o.default_value(), "default"), "default"
    if not values["shm_name"]:
        values["shm_name"] = shm_name_for(values["socket"])
    elif not re.fullmatch(r"[A-Za-z0-9._-]{1,200}", values["shm_name"]):
        raise ConfigError(f"shm_name (from {sources['shm_name']}): {values['shm_name']!r} may only hold "
                          "letters, digits, '.', '_' and '-'")
    sock = str(values["socket"])
    if len(sock.encode()) > UNIX_PATH_MAX:
        raise ConfigError(f"socket (from {sources['socket']}): path {sock!r} is {len(sock.encode())} bytes, "
                          f"over the unix-socket limit of {UNIX_PATH_MAX}; choose a shorter path")
    return Config(**values, sources=sources, config_file=path)


def resolve_gpu_capacity(config: Config, cuda_available: Callable[[], bool]) -> int:
    """The GPU tier's bytes: "auto" -> GPU_AUTO_BYTES where CUDA is present, else 0. An
    explicit non-zero capacity without CUDA is an error (naming where it was set)."""
    has_cuda = cuda_available()
    if config.gpu_capacity is None:
        return GPU_AUTO_BYTES if has_cuda else 0
    if config.gpu_capacity > 0 and not has_cuda:
        raise ConfigError(
            f"gpu_capacity is {format_size(config.gpu_capacity)} (from {config.sources.get('gpu_capacity')}) "
            "but CUDA is not available here; set it to 0 or auto"
        )
    return config.gpu_capacity


def ensure_socket_dir(socket: Path) -> None:
    """Create the socket's directory with mode 0700 when missing. A per-user default
    directory that exists must belong to this user and not be open to others."""
    parent = Path(socket).parent
    if not parent.exists():
        parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(parent, 0o700)
        return
    if not parent.is_dir():
        raise ConfigError(f"socket directory {parent} exists and is not a directory")
    if parent == runtime_dir():
        st = parent.stat()
        if st.st_uid != os.getuid():
            raise ConfigError(f"socket directory {parent} belongs to uid {st.st_uid}, not to you ({os.getuid()})")
        if stat.S_IMODE(st.st_mode) & 0o077:
            os.chmod(parent, 0o700)


def option_names() -> list[str]:
    return [f.name for f in fields(Config) if f.name in OPTIONS_BY_NAME]
