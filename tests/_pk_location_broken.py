"""Imported lazily by test_dispatch: fails at import, which must be recorded, not raised."""

raise ImportError("this peer library is broken on purpose")
