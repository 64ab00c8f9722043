"""epguard's cluster side: the validating admission webhook and its offline twin.

The decision engine (``policy``) is pure: it takes an admission request and the
in-memory state (rules, namespace modes, learned verdicts) and returns a
decision. The server (``app``), the watches (``watch``) and the CLI (``cli``)
only feed it.
"""

__all__: list[str] = []
