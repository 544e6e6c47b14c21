"""Roles: one module (or package) per kind of job a worker can do, on one interface (base.py).

`ROLES` is what `jetllm worker --role` chooses from. Adding a role is adding a module here and a
line below; the runtime serves any `Role` it is given.
"""

from .base import Canary, JobHandle, Role, RoleDeps
from .decode import DecodeRole
from .flags import FlagNotForRole, UnknownRole, check_flags, role_named
from .generate import GenerateRole, Outcome
from .prefill import PrefillRole

ROLES: dict[str, type[Role]] = {r.name: r for r in (GenerateRole, PrefillRole, DecodeRole)}

__all__ = [
    "ROLES",
    "Canary",
    "DecodeRole",
    "FlagNotForRole",
    "GenerateRole",
    "JobHandle",
    "Outcome",
    "PrefillRole",
    "Role",
    "RoleDeps",
    "UnknownRole",
    "check_flags",
    "role_named",
]
