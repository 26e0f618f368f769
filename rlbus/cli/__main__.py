"""``python -m rlbus.cli``: the ``rlbus`` command, as ``python -m rlbus`` is (torchrun lines written that way)."""

from rlbus.cli.app import main

if __name__ == "__main__":
    main()
