"""The replica's state: whole-model and shard-local snapshots, restore and digests, the objects a
user registers, and disk checkpoints."""
