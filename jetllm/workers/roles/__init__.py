"""Roles: one module (or package) per kind of job a worker can do, on one interface (base.py).

`ROLES` is what `jetllm worker --role` chooses from. Adding a role is adding a module here and a
line below; the runtime serves any `Role` it is given.
"""

from .base import Canary, JobHandle, Role, RoleDeps
from .flags import FlagNotForRole, UnknownRole, check_flags, role_named
from .generate import GenerateRole, Outcome

ROLES: dict[str, type[Role]] = {GenerateRole.name: GenerateRole}

__all__ = [
    "ROLES",
    "Canary",
    "FlagNotForRole",
    "GenerateRole",
    "JobHandle",
    "Outcome",
    "Role",
    "RoleDeps",
    "UnknownRole",
    "check_flags",
    "role_named",
]
