"""Starting processes: launcher and scheduler arguments, process groups, listen ports."""
