"""``rlbus blobs``: the HTTP blob server (origin or regional relay), blob keys, claim collection."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from rlbus.cli.common import (
    console,
    err,
    print_error,
    run_async,
    typer_app,
)
from rlbus.errors import RlbusError

app = typer_app(help="Serve weight chunks over HTTP (origin or regional relay).", no_args_is_help=True)


@app.command("serve")
def blobs_serve(
    root: Annotated[Path, typer.Option(help="Directory holding the blobs (the relay's cache with --upstream).")],
    secret: Annotated[
        str | None, typer.Option(envvar="RLBUS_BLOB_SECRET", help="Shared HMAC signing secret (prefer the env var).")
    ] = None,
    secret_file: Annotated[
        Path | None, typer.Option(envvar="RLBUS_BLOB_SECRET_FILE", help="File holding the signing secret.")
    ] = None,
    host: str = "127.0.0.1",
    port: int = 8470,
    upstream: Annotated[
        str | None, typer.Option(help="Origin URL: serve as a read-only pull-through relay for a region.")
    ] = None,
    upstream_secret: Annotated[str | None, typer.Option(
        envvar="RLBUS_UPSTREAM_BLOB_SECRET",
        help="The relay's credential at the origin: a read-only `rlbus blobs key --role relay` key "
             "(default: the serving secret).")] = None,
) -> None:
    """Serve a blob directory over signed HTTP with range reads; with --upstream, relay an origin.

    The secret is the master this server verifies requests and scoped keys (`rlbus blobs key`) with."""
    from rlbus.blobs.http import BlobServer, HttpStore, serve
    from rlbus.blobs.local import LocalStore
    from rlbus.config import secret_from
    from rlbus.launch.signals import GracefulStop

    try:
        secret = secret_from(secret, secret_file, "RLBUS_BLOB_SECRET", field="blobs.secret")
    except RlbusError as exc:
        print_error(exc)
        raise typer.Exit(1) from None
    if not secret:
        raise typer.BadParameter("set RLBUS_BLOB_SECRET or RLBUS_BLOB_SECRET_FILE (or --secret-file)")

    async def go() -> None:
        assert secret is not None
        origin = HttpStore(upstream, secret=upstream_secret or secret) if upstream else None
        server = BlobServer(LocalStore(root), secret=secret, upstream=origin)
        runner = await serve(server, host, port)
        role = f"relay of {upstream}" if upstream else "origin"
        console.print(f"serving {root} on http://{host}:{port} ({role}); Ctrl-C stops")
        try:
            # SIGTERM or SIGINT stops it cleanly, also where the parent shell ignores SIGINT (a background job)
            with GracefulStop() as stopping:
                await stopping.stop.wait()
        finally:
            await runner.cleanup()
            if origin is not None:
                c = server.upstream_count
                console.print(f"relay stopped: fetched {c.blobs} blobs ({c.bytes:,} B) from {upstream} "
                              f"({c.retried_ranges} ranges retried, {c.abandoned} downloads abandoned)")
                await origin.close()
            if origin is not None:
                await origin.close()

    run_async(go)


@app.command("key")
def blobs_key(
    role: Annotated[str, typer.Option(help="trainer, worker, rollout, relay or operator: sets the permissions.")],
    prefix: Annotated[
        str, typer.Option(help="Confine the key to keys under this prefix (run7/); '' is the whole store.")
    ] = "",
    ttl: Annotated[
        str | None, typer.Option(help="Lifetime: 3600s, 30m, 12h, 7d, 2w. Default: never expires.")
    ] = None,
    permissions: Annotated[
        str | None, typer.Option(help="Replace the role's permissions: a subset of read,write,delete,list.")
    ] = None,
    name: Annotated[
        str | None, typer.Option(help="Key id the server logs refusals under. Default: <role>-<6 hex>.")
    ] = None,
    write_prefix: Annotated[
        str | None, typer.Option(help="Confine write and delete to keys under this prefix (claims/).")
    ] = None,
    secret: Annotated[
        str | None, typer.Option(envvar="RLBUS_BLOB_SECRET", help="The server's master secret (prefer the env var).")
    ] = None,
    secret_file: Annotated[
        Path | None, typer.Option(envvar="RLBUS_BLOB_SECRET_FILE", help="File holding the master secret.")
    ] = None,
) -> None:
    """Mint a scoped blob key (rlbus/blobs/keys.py) from the master secret; the key alone goes to stdout.

    Give it to a process as its RLBUS_BLOB_SECRET: reward workers get --role worker (read only), rollout
    workers --role rollout --write-prefix claims/ (read; write their claim-checked payloads), a relay's
    upstream client --role relay (RLBUS_UPSTREAM_BLOB_SECRET)."""
    import time

    from rlbus.blobs.keys import PERMISSIONS, ScopedKey, mint_for_role
    from rlbus.config import secret_from

    try:
        master = secret_from(secret, secret_file, "RLBUS_BLOB_SECRET", field="blobs.secret")
        if not master:
            raise typer.BadParameter("set RLBUS_BLOB_SECRET or RLBUS_BLOB_SECRET_FILE (or --secret-file)")
        key = mint_for_role(master, role, prefix=prefix, ttl=ttl, permissions=permissions, key_id=name,
                            write_prefix=write_prefix)
    except RlbusError as exc:
        print_error(exc)
        raise typer.Exit(1) from None
    claims = ScopedKey.parse(key).claims
    until = "never" if claims.expires is None else time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(claims.expires))
    scope = claims.prefix or "(whole store)"
    granted = ",".join(p for p in PERMISSIONS if p in claims.permissions)
    writes = "" if claims.write_prefix is None else f" (write and delete only under {claims.write_prefix})"
    err.print(f"key {claims.key_id}: {granted} on {scope}{writes}, expires {until}", markup=False, highlight=False)
    sys.stdout.write(key + "\n")


@app.command("collect-claims")
def blobs_collect_claims(
    store: Annotated[str, typer.Option(help="Blob store holding the claims: a directory or http URL.")],
    older_than_hours: Annotated[
        float, typer.Option(help="Delete claims older than this; keep it ≥ the topic's retention (7 days).")
    ] = 168.0,
) -> None:
    """Delete claim-checked payloads (claims/…) older than the retention (rlbus/bus/claimcheck.py)."""
    from rlbus.blobs.open import open_store
    from rlbus.bus.claimcheck import collect_claims

    async def go() -> list[str]:
        async with open_store(store, secret=os.environ.get("RLBUS_BLOB_SECRET")) as blobs:
            return await collect_claims(blobs, older_than_s=older_than_hours * 3600)

    console.print(f"deleted {len(run_async(go))} claim(s) older than {older_than_hours:g} h")
