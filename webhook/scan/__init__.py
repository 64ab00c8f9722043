"""``epguard scan``: an image judged from its archive, before any pod runs it.

``sources`` finds the layers (OCI layout, OCI or docker archive, root filesystem),
``layers`` streams them into ``tree`` (the merged files, whiteouts honoured),
``scanner`` runs the probe's static diagnosis on that tree, ``report`` prints it.
"""
