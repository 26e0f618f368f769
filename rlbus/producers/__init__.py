"""rlbus.producers."""
