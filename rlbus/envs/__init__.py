"""rlbus.envs."""
