"""``rlbus codec``: the weight codec's compiled kernels."""

from __future__ import annotations

from rlbus.cli.common import (
    console,
    err,
    typer_app,
)

app = typer_app(help="The weight codec's compiled kernels.", no_args_is_help=True)


@app.command("warm")
def codec_warm() -> None:
    """Compile the weight codec's kernels into numba's on-disk cache (bf16, fp16, fp32), so no process pays
    for compilation during a run; `make` runs it at install. Prints where the cache is and how long it took."""
    from rlbus.weights.codec.warm import cache_location, warm_kernels

    with err.status("compiling the weight codec's kernels (a first run on this machine takes ~15 s a dtype)"):
        took = warm_kernels()
    console.print(f"codec kernels ready in {took:.1f} s; cache: {cache_location()}")
