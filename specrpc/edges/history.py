"""Chat histories: the roles a message may have."""

from __future__ import annotations

from specrpc.edges.validation import InvalidRequest

ROLES = ("system", "user", "assistant", "tool")
Message = tuple[str, str]  # (role, text)


def check_role(role: str, name: str) -> str:
    """`role` if it is one of ROLES, else InvalidRequest naming the field `name`."""
    if role not in ROLES:
        raise InvalidRequest(f"{name} {role[:32]!r} is not supported; use one of {', '.join(ROLES)}")
    return role
