"""`PicSettings`: the one settings object of position-independent caching and of the store
connector, with ONE set of defaults, and its TOML form (`--pic-config FILE`).

`kvengine run`, `kvengine serve`, tools/bench_serving.py and tools/quality.py all start
from `PicSettings()` and change only what their user asked for, so an entry point never
carries defaults of its own. A file has two tables, each key a field of the dataclass it
names (docs/pic.md, "Settings"; example: docs/examples/pic.toml):

    [pic]     # PicConfig (engine/pic/config.py): method, seam, miss_path, ...
    [store]   # StoreConnectorConfig (engine/connector/config.py): share_cold, timeouts, ...

Only the fields a user chooses between are keys (`PIC_KEYS`, `STORE_KEYS`); experiment
switches stay fields of the dataclasses for the tools that A/B them, and where the daemon
is comes from `--store`, not from the file. An unknown table or key, a value of the wrong
type or a value the dataclass refuses is a `PicSettingsError` whose one-line message
names the file and the key.
"""
from __future__ import annotations

import dataclasses
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional

from engine.connector.config import StoreConnectorConfig
from engine.connector.errors import ConnectorConfigError
from engine.pic.config import PicConfig
from engine.pic.errors import PicConfigError

#: PicConfig fields a `[pic]` table may set, with the TOML types each accepts
PIC_KEYS: dict[str, tuple[type, ...]] = {
    "method": (str,),
    "seam": (int,),
    "swa_seam": (str,),
    "anchor": (str,),
    "state_dtype": (str,),
    "kernel": (str,),
    "signature_cache_bytes": (int,),
    "prefix_cache_bytes": (int,),
    "sync_timing": (bool,),
    "keep_end_state": (bool,),
    "fused": (bool,),
    "cold_full_fraction": (int, float),
    "cold_full_policy": (str,),
    "miss_path": (str,),
    "miss_signatures": (str,),
    "exact_prefix": (bool,),
    "exact_prefix_store": (str,),
    "exact_prefix_passes": (str,),
    "idle_alone_passes": (str,),
    "idle_batch_tokens": (int,),
}
#: StoreConnectorConfig fields a `[store]` table may set (the socket comes from --store)
STORE_KEYS: dict[str, tuple[type, ...]] = {
    "rpc_timeout_s": (int, float),
    "load_timeout_s": (int, float),
    "inflight_wait_s": (int, float),
    "reconnect_min_s": (int, float),
    "reconnect_max_s": (int, float),
    "put_queue_depth": (int,),
    "put_tier": (str,),
    "prefetch_queued": (int,),
    "dedup": (bool,),
    "verify": (bool,),
    "share_cold": (bool,),
    "share_min_segments": (int,),
    "share_poll_s": (int, float),
    "share_wait_s": (int, float),
    "share_pack_tokens": (int,),
    "share_keep": (int, float),
    "device_cache_bytes": (int,),
    "device_cache_fraction": (int, float),
    "nvme_read_backend": (str,),
    "tier_admission": (str,),
}
TABLES = {"pic": PIC_KEYS, "store": STORE_KEYS}
#: a TOML value that stands for None where the field allows it (TOML has no null)
NONE_WORDS = {"cold_full_fraction": 0, "put_tier": "default"}


class PicSettingsError(ConnectorConfigError):
    """A settings file or a settings change is invalid; the message names the key."""


@dataclass(frozen=True)
class PicSettings:
    """PIC's options (`pic`) and the store connector's (`store`, used with `--store`)."""

    pic: PicConfig = field(default_factory=PicConfig)
    store: StoreConnectorConfig = field(default_factory=StoreConnectorConfig)

    def with_pic(self, **changes: Any) -> PicSettings:
        """These settings with PicConfig fields changed (None values are left out: an
        option the user did not give); a refused value raises PicSettingsError."""
        changes = {k: v for k, v in changes.items() if v is not None}
        try:
            return dataclasses.replace(self, pic=dataclasses.replace(self.pic, **changes))
        except PicConfigError as exc:
            raise PicSettingsError(str(exc)) from None

    def connector(self, store: Optional[str]) -> Optional[StoreConnectorConfig]:
        """The connector config of a `--store` value: None (option absent) -> None (no
        daemon); "" (given without a value) -> the daemon's default socket; else that
        socket, with the `[store]` settings."""
        if store is None:
            return None
        try:
            return dataclasses.replace(self.store, socket=store or None)
        except ConnectorConfigError as exc:
            raise PicSettingsError(str(exc)) from None


def _type_name(types: tuple[type, ...]) -> str:
    return " or ".join({bool: "true/false", int: "an integer", float: "a number", str: "a string"}[t]
                       for t in types)


def _value(where: str, table: str, key: str, value: Any, types: tuple[type, ...]) -> Any:
    ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in types)
    if ok and isinstance(value, float) and not math.isfinite(value):
        ok = False
    if not ok:
        raise PicSettingsError(f"{where}: {table}.{key} = {value!r} must be {_type_name(types)}")
    if key in NONE_WORDS and NONE_WORDS[key] == value and not isinstance(value, bool):
        return None
    return value


def settings_from_mapping(data: Mapping[str, Any], where: str = "settings",
                          base: Optional[PicSettings] = None) -> PicSettings:
    """`base` (default: PicSettings()) changed by a parsed settings file's tables."""
    base = base or PicSettings()
    for table in data:
        if table not in TABLES:
            raise PicSettingsError(f"{where}: unknown table [{table}] (tables: {', '.join(f'[{t}]' for t in TABLES)})")
        if not isinstance(data[table], Mapping):
            raise PicSettingsError(f"{where}: {table} must be a table ([{table}]), not a value")
    parsed: dict[str, dict[str, Any]] = {}
    for table, keys in TABLES.items():
        values = {}
        for key, value in data.get(table, {}).items():
            if key not in keys:
                raise PicSettingsError(f"{where}: unknown key {table}.{key} (keys of [{table}]: {', '.join(keys)})")
            values[key] = _value(where, table, key, value, keys[key])
        parsed[table] = values
    try:
        pic = dataclasses.replace(base.pic, **parsed["pic"])
    except PicConfigError as exc:
        raise PicSettingsError(f"{where}: {_keyed('pic', str(exc))}") from None
    try:
        store = dataclasses.replace(base.store, **parsed["store"])
    except ConnectorConfigError as exc:
        raise PicSettingsError(f"{where}: {_keyed('store', str(exc))}") from None
    return PicSettings(pic=pic, store=store)


def _keyed(table: str, message: str) -> str:
    """A dataclass's "name=value must be ..." as "table.name = value must be ..."."""
    name, sep, rest = message.partition("=")
    if sep and name.isidentifier():
        return f"{table}.{name} = {rest}"
    return message


def load_settings(path: str | Path, base: Optional[PicSettings] = None) -> PicSettings:
    """The settings of a TOML file (module docstring) over `base` (default PicSettings())."""
    p = Path(path)
    try:
        with p.open("rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise PicSettingsError(f"{p}: cannot read ({exc.strerror or exc})") from None
    except tomllib.TOMLDecodeError as exc:
        raise PicSettingsError(f"{p}: not valid TOML ({exc})") from None
    return settings_from_mapping(data, str(p), base)
