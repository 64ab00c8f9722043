"""The epguard controller: a kopf operator with one module per concern.

``certificates``  self-managed TLS for the webhook (CA + serving cert in a Secret,
                  caBundle injection, rotation with an overlap)
``probe_key``     the key that signs injected probes: created, rotated, held
``background``    (a helper) the start/stop of a loop that lives as long as the operator
``recorder``      probe outcomes in pod status → ImageVerdicts + Events on pod and owner
``architectures`` probes teach only where every node shares one architecture (a
                  verdict is per image, not per platform); their verdicts are forgotten
                  when a second one joins
``gatekeeper``    the preflight gate: one preflight pod per unjudged image, the gate on
                  the pods waiting on it decided from its result
``owners``        (a helper) the top owner of a pod, for Events where people look
``backstop``      the outage backstop: ValidatingAdmissionPolicies compiled from the
                  deny rules and Unusable verdicts, and their parameter ConfigMaps
``compiler``      (pure) that compile: rules and verdicts → policies and parameters
``authority``     (pure) the certificate authority ``certificates`` runs
``login``         in-cluster authentication for kopf that needs no cluster DNS
``peering``       the ClusterKopfPeering object kopf needs for HA
``leadership``    (a helper) whether this replica is the one kopf peering keeps active,
                  for the loops kopf does not pause (gatekeeper's passes, backstop's writer)

Every API call goes through one official ``kubernetes`` ApiClient that ``__main__``
builds (``webhook/cluster/kube.py``) and puts in kopf's memo as ``api``. A new concern is a new
module holding its kopf handlers, added to ``HANDLER_MODULES``; ``__main__`` imports each
one before kopf starts, which is all kopf needs to register the handlers.
"""

# kopf runs one object's event handlers one after another, in the order they were
# registered: the gatekeeper's (a note and a wake-up) before the recorder's (API writes,
# up to a second or more on a loaded API server), so a preflight's answer reaches its
# waiting pods without waiting for its verdict to be written.
HANDLER_MODULES: tuple[str, ...] = (
    "epguard.webhook.controller.login",
    "epguard.webhook.controller.certificates",
    "epguard.webhook.controller.probe_key",
    "epguard.webhook.controller.gatekeeper",
    "epguard.webhook.controller.recorder",
    "epguard.webhook.controller.architectures",
    "epguard.webhook.controller.backstop",
)
