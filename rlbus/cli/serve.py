"""``rlbus serve``: the OpenAI-compatible gateway."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from rlbus.cli.common import (
    SMOLLM2,
    Bootstrap,
    console,
    err,
    print_error,
    run_async,
)
from rlbus.errors import RlbusError


def serve(
    config: Annotated[Path | None, typer.Option("--config", envvar="RLBUS_CONFIG", help=(
        "Run config (TOML): serve the run's model, weights following its trainer, recording on its bus; "
        "the config's serve table sets port, tokens, sessions."))] = None,
    model: Annotated[str | None, typer.Option(help="A shipped model (default smollm2-135m-instruct), a model "
                                                   "directory, a .gguf file, or a preset (tiny, bench, demo).")] = None,
    port: Annotated[int | None, typer.Option(help="Port (default 8000, or the config's serve.port).")] = None,
    host: Annotated[str, typer.Option(help="Interface, without --config (tenant tokens are always required; "
                                           "/metrics off loopback needs $RLBUS_METRICS_TOKEN).")] = "127.0.0.1",
    token_file: Annotated[Path | None, typer.Option(envvar="RLBUS_SERVE_TOKEN_FILE", help=(
        "File of 'tenant: token' lines (else $RLBUS_SERVE_TOKENS='tenant:token,…')."))] = None,
    bootstrap: Bootstrap = "127.0.0.1:9092",
    user_sessions: Annotated[
        bool, typer.Option(help="Without --config: the 'user' field marks an RL session.")] = False,
    device: Annotated[str, typer.Option(help="auto, cpu, cuda … (without --config).")] = "auto",
) -> None:
    """An OpenAI-compatible gateway (/v1/chat/completions, /v1/models, /rl/sessions/{id}/reward) on the rollout
    engine; every completion is recorded token-exact on rl.served.v1 (buffered while Kafka is down).

    Example: rlbus serve --model smollm2-135m-instruct --port 8000
    """
    from rlbus.launch.signals import GracefulStop

    if config is not None:
        from rlbus.launch.config import load_config
        from rlbus.launch.roles import default_worker_id, serve_main

        async def go_config() -> None:
            await serve_main(load_config(config), worker_id=default_worker_id("serve", None), model=model,
                             port=port, token_file=token_file)

        run_async(go_config)
        return
    from rlbus.models.sources import parse_model
    from rlbus.serve.auth import load_tenants
    from rlbus.serve.stack import standalone

    try:
        source = parse_model(model or SMOLLM2, device=device, progress=err.print)
    except RlbusError as exc:
        hint = "" if model else " (or serve an in-house policy: --model tiny)"
        print_error(exc, hint)
        raise typer.Exit(1) from None

    async def go() -> None:
        tenants = load_tenants(token_file)
        with GracefulStop() as stopping:
            console.print(f"serving {Path(model or SMOLLM2).name} on http://{host}:{port or 8000}/v1 for tenants "
                          f"{', '.join(tenants.names)}; recording to Kafka at {bootstrap}; Ctrl-C stops")
            await standalone(source, tenants, stopping.stop, bootstrap=bootstrap, host=host, port=port or 8000,
                             user_sessions=user_sessions, model_name=Path(model or SMOLLM2).name)

    run_async(go)
