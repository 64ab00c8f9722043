"""epguard's cluster side, in five parts (each imports only from the ones below it).

``admission``   the HTTPS admission webhook (/validate, /mutate) on the engine
``controller``  the kopf operator: learned verdicts, the outage backstop, certificates
``scan``        ``epguard scan``: an image archive judged before any pod runs it
``cluster``     the one Kubernetes API client and the webhook's watches
``engine``      the pure decision engine: no I/O, no API calls

``settings`` (every option of both processes, one table) and ``metrics`` sit between
the engine and the rest; ``command`` is the ``epguard`` command.
"""
