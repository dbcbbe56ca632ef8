"""The protocol cores: sans-IO state machines (views, gossip, Raft, the step decision) and
their typed messages and codec. No sockets, no clocks, no threads, no torch."""
