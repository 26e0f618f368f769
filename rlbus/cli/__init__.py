"""The ``rlbus`` command line: one typer app (:mod:`rlbus.cli.app`), one module per command or command group.

Each command parses its options and calls a library function; nothing here holds library logic.
"""


def main() -> None:  # pragma: no cover - the console script
    from rlbus.cli.app import main as run

    run()
