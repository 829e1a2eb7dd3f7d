"""The checks every option and request field goes through: a ValueError that names the field
(`name: message`), so a bad CLI option, Python argument or input row says what to fix."""

from __future__ import annotations

import math


def check(cond: bool, name: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"{name}: {msg}")


def check_choice(value: object, name: str, allowed: tuple[str, ...]) -> None:
    check(value in allowed, name, f"must be one of {', '.join(allowed)}; got {value!r}")


def check_int(value: object, name: str) -> None:
    check(
        isinstance(value, int) and not isinstance(value, bool),
        name,
        f"must be an integer, got {value!r}",
    )


def check_num(value: object, name: str) -> None:
    check(
        isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value),
        name,
        f"must be a finite number, got {value!r}",
    )
