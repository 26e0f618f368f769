"""``rlbus feedback``: live user feedback on served rollouts → rewards."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from rlbus.cli.common import (
    Bootstrap,
    ConfigFile,
    console,
    kafka_bus,
    run_async,
    typer_app,
)

app = typer_app(help="Live user feedback on served rollouts → rewards.", no_args_is_help=True)


TokenFile = Annotated[
    Path | None,
    typer.Option("--token-file", envvar="RLBUS_FEEDBACK_TOKEN_FILE",
                 help="File holding the bearer token; else $RLBUS_FEEDBACK_TOKEN (never a command-line value)."),
]


@app.command("serve")
def feedback_serve(
    port: int = 8471,
    host: Annotated[str, typer.Option(
        help="Interface to bind (every request but /healthz needs the token).")] = "127.0.0.1",
    token_file: TokenFile = None,
    bootstrap: Bootstrap = "127.0.0.1:9092",
    config: ConfigFile = None,
) -> None:
    """Serve POST /v1/feedback and /v1/feedback:batch: user signals become rewards (source "user") on
    rl.rewards.v1. API and value mapping: rlbus/producers/feedback.py."""
    from rlbus.launch.signals import GracefulStop
    from rlbus.producers.feedback import FeedbackServer, load_token

    async def go() -> None:
        token = load_token(file=token_file)
        with GracefulStop() as stopping:  # docker stop / Ctrl-C: finish requests in flight, then exit
            async with kafka_bus(bootstrap, config) as bus:
                console.print(f"feedback API on http://{host}:{port}; Ctrl-C stops")
                await FeedbackServer(bus=bus, token=token).run(stopping.stop, host, port)

    run_async(go)


@app.command("send")
def feedback_send(
    rollout_id: Annotated[str, typer.Argument(help="The served rollout.")],
    up: Annotated[bool | None, typer.Option("--up/--down", help="Thumbs up or down.", show_default=False)] = None,
    score: Annotated[float | None, typer.Option(help="Graded score in [0, 1], agreeing with --up/--down.")] = None,
    user: Annotated[str | None, typer.Option(help="Who rated (retries then keep one reward id).")] = None,
    comment: str | None = None,
    prompt_id: Annotated[str | None, typer.Option(help="Only when ROLLOUT_ID is not <prompt_id>/<index>.")] = None,
    url: Annotated[str, typer.Option(envvar="RLBUS_FEEDBACK_URL", help="The feedback server.")] = (
        "http://127.0.0.1:8471"
    ),
    token_file: TokenFile = None,
) -> None:
    """Post one signal to a running feedback server; prints where its reward landed on the log."""
    from rlbus.producers.feedback import Feedback, load_token, send_feedback

    if up is None:
        raise typer.BadParameter("give --up or --down")
    item = Feedback(rollout_id=rollout_id, signal="up" if up else "down", score=score, user=user,
                    comment=comment, prompt_id=prompt_id)

    async def go() -> dict[str, Any]:
        return await send_feedback(url, load_token(file=token_file), item)

    console.print_json(json.dumps(run_async(go)))
