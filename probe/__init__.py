"""epguard's in-image probe: can this image serve SGLang elastic EP on mooncake?

Standard library only, Python 3.8+. Run it as ``python3 probe -- WORKER_ARGV...``
from a copied directory or as ``python3 -m epguard.probe``. See docs/probe.md.
"""
