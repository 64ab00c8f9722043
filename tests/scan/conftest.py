"""Fixtures of the scan tests; the helpers live in scan_harness.py (a module of its own,
since every test directory has a conftest and only one can be imported as `conftest`)."""

from tests.scan.scan_harness import pieces

__all__ = ["pieces"]
