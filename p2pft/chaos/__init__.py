"""`p2pft chaos`: a local cluster under a failure schedule, measured against its denominators."""
