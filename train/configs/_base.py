"""Keys every config has, with the Flax WMT example's names where one exists.

`base_config()` is made from the fields of the run config's parts (`train.run_config`):
each key's default, its rule and what it means are declared there, once.
"""

from train.run_config import base_config

__all__ = ["base_config"]
