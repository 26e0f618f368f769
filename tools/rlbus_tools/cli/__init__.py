"""The commands rlbus-tools adds to ``rlbus`` (entry points of the ``rlbus.cli`` group): ``bench``, ``sim``,
``kafka`` and ``up``."""
