"""p2pft inside the trainers people already run, out of their trees.

Each integration is one module that plugs into its trainer's own extension mechanism (no fork, no
patch of the trainer's source) and drives p2pft's documented loop (``begin`` / ``commit``) in place
of the trainer's step. Each needs its trainer installed (an extra: ``pip install -e
".[torchtitan]"``); importing this package needs nothing.

- ``p2pft.trainer.integrations.torchtitan``: a torchtitan ``Trainer`` and config selected with
  torchtitan's ``--module`` / ``--config`` (docs/torchtitan.md).
"""
