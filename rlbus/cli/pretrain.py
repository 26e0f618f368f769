"""``rlbus pretrain``: the supervised warm start."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from rlbus.cli.common import (
    console,
    print_error,
)
from rlbus.errors import RlbusError


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
    device: Annotated[str, typer.Option(help="auto (CUDA when there is one), cpu, cuda …")] = "auto",
) -> None:
    """Supervised warm start ("mid-training") on reference solutions, so RL starts from a model that
    is sometimes right."""
    from rlbus.training.sft import main as sft_main

    try:
        losses = sft_main(data, out, model=model, init=init, steps=steps, lr=lr, batch_size=batch_size, seed=seed,
                          log=console.print, device=device)
    except (RlbusError, ValueError) as exc:
        print_error(exc)
        raise typer.Exit(1) from None
    console.print(f"done: loss {losses[0]:.3f} → {losses[-1]:.3f}; checkpoint in {out}" if losses
                  else f"checkpoint in {out}")
