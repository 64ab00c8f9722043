"""The epguard controller: a kopf operator with one module per concern.

``certificates``  self-managed TLS for the webhook (CA + serving cert in a Secret,
                  caBundle injection, rotation with an overlap)
``recorder``      probe outcomes in pod status → ImageVerdicts + Events on pod and owner
``login``         in-cluster authentication that needs no cluster DNS

A new concern (for example the ImageVerdict recorder) is a new module holding its kopf
handlers, added to ``HANDLER_MODULES``; ``__main__`` imports each one before kopf starts,
which is all kopf needs to register the handlers.
"""

HANDLER_MODULES: tuple[str, ...] = (
    "webhook.controller.login",
    "webhook.controller.certificates",
    "webhook.controller.recorder",
)
