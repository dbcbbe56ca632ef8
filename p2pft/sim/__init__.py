"""A virtual network and clock that run the same protocol cores as production."""
