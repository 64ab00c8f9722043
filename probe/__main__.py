"""``python3 probe -- WORKER_ARGV...`` (a copied directory) or ``python3 -m epguard.probe``."""

import sys

if __package__:  # python3 -m epguard.probe
    from .cli import main
else:  # python3 /path/to/probe: this directory is sys.path[0]
    from cli import main

sys.exit(main())
