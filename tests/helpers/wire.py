"""The structs of jetllm.schemas that travel on the wire: every one but the bases."""

from __future__ import annotations

import importlib
import pkgutil

import msgspec

from jetllm import schemas
from jetllm.schemas.common import BASES


def wire_structs() -> list[type[msgspec.Struct]]:
    """Every Struct defined in a module of jetllm.schemas, except bases: private ones (`_Frame`)
    and the rule bases (`schemas.common.BASES`)."""
    found = []
    for info in pkgutil.iter_modules(schemas.__path__):
        module = importlib.import_module(f"{schemas.__name__}.{info.name}")
        for obj in vars(module).values():
            if (
                isinstance(obj, type)
                and issubclass(obj, msgspec.Struct)
                and obj.__module__ == module.__name__
                and not obj.__name__.startswith("_")
                and obj not in BASES
            ):
                found.append(obj)
    return found
