"""Colocated transport: the trainer and its inference engine process share one device."""
