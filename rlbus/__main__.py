"""``python -m rlbus``: the ``rlbus`` command (how torchrun and the launchers start a role)."""

from rlbus.cli.app import main

if __name__ == "__main__":
    main()
