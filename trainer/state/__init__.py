"""The replica's state: whole-model and shard-local snapshots, restore and digests (the two
layouts: ``layouts.py``), and disk checkpoints."""
