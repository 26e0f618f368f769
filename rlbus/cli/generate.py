"""``rlbus generate``: one chat turn through the rollout engine."""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer

from rlbus.cli.common import (
    SMOLLM2,
    console,
    err,
    print_error,
)
from rlbus.errors import RlbusError


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
        print_error(exc)
        raise typer.Exit(1) from None
    if as_json:
        sys.stdout.write(json.dumps(turn.as_dict()) + "\n")
        return
    console.print(turn.text, markup=False, highlight=False)
    err.print(f"[dim]{len(turn.token_ids)} tokens ({turn.finish_reason}) in {turn.seconds:.2f} s, "
              f"{turn.tokens_per_s:.1f} tok/s; prompt {turn.prompt_tokens} tokens[/dim]")
