"""The coding environment (see env.py)."""
