"""How a replica gets the committed state back from its peers: catch-up from a snapshot (the
joiner's side), the donor that serves snapshots, and the short log of recent steps that peers
fast-forward through."""
