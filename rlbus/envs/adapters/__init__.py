"""Adapters for other libraries' environments, one boundary module each (docs/architecture.md §6).

    reasoning_gym.py  ``reasoning_gym``: reasoning-gym's procedural datasets, scored by their own
                      ``score_answer`` (``env = "reasoning_gym:basic_arithmetic"``)
    verifiers.py      ``verifiers``: Prime Intellect's verifiers (v1) tasksets, scored by their tasks' own
                      ``@vf.reward`` methods (``env = "verifiers:my-taskset"``)

An adapter is registered under its library's name and sets `Environment.name_field`, so
``env = "<adapter>:<item>"`` picks one of the library's environments. The library itself is imported only
when such an environment is made (``pip install 'rlbus[envs]'``): importing `rlbus.envs` stays light.
"""

from rlbus.envs.adapters import reasoning_gym, verifiers

__all__ = ["reasoning_gym", "verifiers"]
