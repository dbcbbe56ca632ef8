"""How a replica gets the committed state back from its peers: catch-up from a snapshot (the
joiner's side) and the donor that serves snapshots (the short log of recent steps that peers
fast-forward through is the kernel's: ``kernel/recent.py``)."""
