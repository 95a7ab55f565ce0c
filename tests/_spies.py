"""Counting the calls a function gets while a test runs."""

from __future__ import annotations

from typing import Any


def count_calls(monkeypatch, owner: Any, name: str) -> list[int]:
    """Replace ``owner.name`` with a wrapper that appends to the returned list at each call and
    then calls the real function (undone with ``monkeypatch``)."""
    calls: list[int] = []
    real = getattr(owner, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return calls
