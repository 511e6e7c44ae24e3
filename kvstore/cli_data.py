"""The `kvstore` commands that move objects: `put`, `get`, `rm`, `evict`, `prefetch`.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import sys
from pathlib import Path
from typing import Any, Optional

import typer

from kvstore.cli_common import (
    app, fail, JsonOpt, KeyArg, open_client, print_json, reports_errors, SocketOpt, TcpCaOpt, TcpOpt, TcpTokenOpt,
    TierOpt,
)
from kvstore.cli_help import PlainHelpCommand
from kvstore.config import format_size
from kvstore.errors import KVStoreError
from kvstore.rpc.codec import key_from_text, key_text


@app.command("put", cls=PlainHelpCommand)
@reports_errors
def put_cmd(
    key: str = KeyArg,
    file: Path = typer.Argument(..., help="file whose bytes to store ('-' for stdin)", metavar="FILE"),
    tier: Optional[str] = TierOpt,
    fingerprint: str = typer.Option("", "--fingerprint", help="model fingerprint to record", metavar="FP",
                                    show_default=False),
    replace: bool = typer.Option(False, "--replace",
                                 help="when the key holds other bytes, delete that object and store this file"),
    socket: Optional[Path] = SocketOpt,
    tcp: Optional[str] = TcpOpt,
    tcp_token_file: Optional[Path] = TcpTokenOpt,
    tcp_tls_ca: Optional[Path] = TcpCaOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Store a file's bytes as one object. A key that already holds the same bytes is left
    as it is; one that holds other bytes is an error unless --replace is given."""
    from kvstore import checksums

    k = key_from_text(key)
    replaced = False
    with open_client(socket, tcp, tcp_token_file, tcp_tls_ca) as kv, _file_bytes(file) as data:
        if len(data) == 0:
            raise KVStoreError(f"{file} is empty; objects must hold at least 1 byte")
        res = kv.put(k, data, tier=tier, fingerprint=fingerprint)
        if res.status != "stored":
            held = kv.show(k).info
            same = held.size == len(data) and held.checksum == checksums.host_checksum(data)
            if not same and replace:
                if kv.delete([k]) != 1:
                    raise KVStoreError(f"{key} is in use (leased by a reader); cannot replace it now, try again")
                res = kv.put(k, data, tier=tier, fingerprint=fingerprint)
                replaced = True
            elif not same:
                out = {"key": key_text(res.key), "tier": held.tier, "size": held.size, "status": "exists",
                       "same_bytes": False, "file_size": len(data)}
                if as_json:
                    print_json(out)
                raise KVStoreError(
                    f"{key} already holds other bytes ({format_size(held.size)} in {held.tier}; this file: "
                    f"{format_size(len(data))}); kept them. Pass --replace to store this file instead")
            else:
                res = dataclasses.replace(res, tier=held.tier, size=held.size, checksum=held.checksum)
    if as_json:
        print_json({"key": key_text(res.key), "tier": res.tier, "size": res.size, "status": res.status,
                     **({"same_bytes": True} if res.status != "stored" else {}),
                     **({"replaced": True} if replaced else {})})
    elif res.status != "stored":
        print(f"already present: {key_text(res.key)} ({format_size(res.size)}) in {res.tier}, same bytes")
    else:
        print(f"{'replaced' if replaced else 'stored'} {key_text(res.key)} ({format_size(res.size)}) in {res.tier}")


class _file_bytes:
    """The bytes of a file as a memoryview over a read-only mapping (stdin: read fully)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._mm: Optional[mmap.mmap] = None
        self._mv: Optional[memoryview] = None

    def __enter__(self) -> memoryview:
        if str(self.path) == "-":
            self._mv = memoryview(sys.stdin.buffer.read())
            return self._mv
        if not self.path.is_file():
            raise KVStoreError(f"{self.path} is not a file")
        with open(self.path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if size == 0:
                self._mv = memoryview(b"")
                return self._mv
            self._mm = mmap.mmap(fh.fileno(), size, prot=mmap.PROT_READ)
        self._mv = memoryview(self._mm)
        return self._mv

    def __exit__(self, *exc: Any) -> None:
        try:
            if self._mv is not None:
                self._mv.release()
            if self._mm is not None:
                self._mm.close()
        except BufferError:  # a failing put's traceback still refers to the bytes; exit unmaps
            pass


@app.command("get", cls=PlainHelpCommand)
@reports_errors
def get_cmd(
    key: str = KeyArg,
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="write here instead of stdout",
                                          show_default=False, metavar="FILE"),
    socket: Optional[Path] = SocketOpt,
    tcp: Optional[str] = TcpOpt,
    tcp_token_file: Optional[Path] = TcpTokenOpt,
    tcp_tls_ca: Optional[Path] = TcpCaOpt,
) -> None:
    """Write an object's bytes to a file or stdout."""
    with open_client(socket, tcp, tcp_token_file, tcp_tls_ca) as kv:
        with kv.get(key_from_text(key)) as view:
            data = view.memoryview if view.tier != "gpu" else memoryview(view.tobytes())
            if output is None:
                sys.stdout.buffer.write(data)
                sys.stdout.buffer.flush()
            else:
                tmp = output.with_name(output.name + ".part")
                with open(tmp, "wb") as fh:
                    fh.write(data)
                os.replace(tmp, output)
            data.release()


@app.command("rm", cls=PlainHelpCommand)
@reports_errors
def rm_cmd(
    keys: list[str] = typer.Argument(..., help="keys to delete", metavar="KEY"),
    socket: Optional[Path] = SocketOpt,
    tcp: Optional[str] = TcpOpt,
    tcp_token_file: Optional[Path] = TcpTokenOpt,
    tcp_tls_ca: Optional[Path] = TcpCaOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Delete objects (a leased object stays until its leases end). Exits 1 when a key was
    not in the store or could not be deleted (named on stderr)."""
    ks = [key_from_text(k) for k in keys]
    with open_client(socket, tcp, tcp_token_file, tcp_tls_ca) as kv:
        present = [e.key for e in kv.lookup(ks) if e.hit]
        deleted = kv.delete(present) if present else 0
        left = {e.key for e in kv.lookup(present) if e.hit} if deleted < len(present) else set()
    missing = [key_text(k) for k in dict.fromkeys(ks) if k not in set(present)]
    leased = [key_text(k) for k in present if k in left]
    if as_json:
        print_json({"requested": len(keys), "deleted": deleted, "missing": missing, "leased": leased})
    else:
        print(f"deleted {deleted} of {len(keys)}")
    problems = ([f"not in the store: {', '.join(missing)}"] if missing else []) + (
        [f"in use (leased), left in place: {', '.join(leased)}"] if leased else [])
    if problems:
        fail("; ".join(problems))


@app.command("evict", cls=PlainHelpCommand)
@reports_errors
def evict_cmd(
    tier: str = typer.Option(..., "--tier", help="tier to empty: gpu -> cpu, cpu -> nvme, nvme -> dropped",
                             metavar="TIER"),
    socket: Optional[Path] = SocketOpt,
    tcp: Optional[str] = TcpOpt,
    tcp_token_file: Optional[Path] = TcpTokenOpt,
    tcp_tls_ca: Optional[Path] = TcpCaOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Demote every unleased object out of a tier to the next tier down (dropped when no
    enabled tier lies below it)."""
    with open_client(socket, tcp, tcp_token_file, tcp_tls_ca) as kv:
        enabled = list(kv.info.tiers) if kv.info else []
        moved = kv.evict(tier)
    below = enabled[enabled.index(tier) + 1:] if tier in enabled else []
    if as_json:
        print_json({"tier": tier, "moved": moved, "to": below[0] if below else None})
    elif below:
        print(f"moved {moved} object(s) from {tier} to {below[0]}")
    else:
        print(f"dropped {moved} object(s) from {tier} (no slower tier)")


@app.command("prefetch", cls=PlainHelpCommand)
@reports_errors
def prefetch_cmd(
    keys: list[str] = typer.Argument(..., help="keys to promote", metavar="KEY"),
    tier: Optional[str] = typer.Option(None, "--tier", help="target tier [default: the fastest enabled]",
                                       metavar="TIER", show_default=False),
    socket: Optional[Path] = SocketOpt,
    tcp: Optional[str] = TcpOpt,
    tcp_token_file: Optional[Path] = TcpTokenOpt,
    tcp_tls_ca: Optional[Path] = TcpCaOpt,
) -> None:
    """Promote objects to a faster tier ahead of use."""
    with open_client(socket, tcp, tcp_token_file, tcp_tls_ca) as kv:
        n = kv.prefetch([key_from_text(k) for k in keys], tier)
    print(f"{n} of {len(keys)} in {tier or 'the fastest tier'} or above")
