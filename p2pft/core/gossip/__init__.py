"""SWIM membership with the Lifeguard refinements: the member table, probes, broadcasts."""
