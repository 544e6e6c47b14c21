"""Which CLI flags a role accepts: data on each role, checked before a worker starts.

A flag that only some role uses (`--enable-lora` for generate) is declared in that role's `flags`.
Given to a role that does not declare it, it would be silently ignored, so it is an error that
names the flag and the roles it belongs to. A flag no role declares is common to every role.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from .base import Role


class UnknownRole(ValueError):
    pass


class FlagNotForRole(ValueError):
    pass


def role_named(name: str, roles: Mapping[str, type[Role]]) -> type[Role]:
    try:
        return roles[name]
    except KeyError:
        raise UnknownRole(
            f"--role {name!r} is not a role of this worker; roles: {', '.join(sorted(roles))}"
        ) from None


def misplaced(role: str, given: Iterable[str], roles: Mapping[str, type[Role]]) -> dict[str, list[str]]:
    """Each given flag that some roles declare but `role` does not -> the roles that declare it."""
    out: dict[str, list[str]] = {}
    for flag in given:
        owners = sorted(name for name, cls in roles.items() if flag in cls.flags)
        if owners and role not in owners:
            out[flag] = owners
    return out


def check_flags(role: str, given: Iterable[str], roles: Mapping[str, type[Role]]) -> type[Role]:
    """The role's class; raises if the role is unknown or a given flag means nothing for it."""
    cls = role_named(role, roles)
    bad = misplaced(role, given, roles)
    if bad:
        flag, owners = next(iter(sorted(bad.items())))
        more = f" (also: {', '.join(sorted(bad)[1:])})" if len(bad) > 1 else ""
        raise FlagNotForRole(
            f"{flag} means nothing for --role {role}: it is a flag of the {', '.join(owners)} role; "
            f"leave it out{more}"
        )
    return cls
