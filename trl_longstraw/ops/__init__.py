"""Token-mixer operations LongStraw runs in its own way (under context parallelism), each beside its naive reference."""
