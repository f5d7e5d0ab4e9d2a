"""Experiment configs: `get(name_or_path)` returns an `ml_collections.ConfigDict`.

Each config file's docstring gives its command, expected result and hardware. Names: the
module names in this folder (`default`, `copy`, ...); a path to a `.py` file defining
`get_config()` also works.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import pkgutil

import ml_collections

from models.errors import UserError


def names() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))


def get(name_or_path: str) -> ml_collections.ConfigDict:
    """The config `name_or_path`: a name from `names()` or a path to a config file."""
    if name_or_path.endswith(".py"):
        if not os.path.isfile(name_or_path):
            raise FileNotFoundError(f"config file {name_or_path!r} does not exist")
        spec = importlib.util.spec_from_file_location("_user_config", name_or_path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    elif name_or_path in names():
        module = importlib.import_module(f"train.configs.{name_or_path}")
    else:
        raise UserError(f"unknown config {name_or_path!r}; available: {', '.join(names())} "
                         "or a path to a .py file with get_config()")
    return module.get_config()
