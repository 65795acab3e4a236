"""vLLM as the inference engine: the refit's backend inside vLLM's worker and its trainer-facing
control surface (``transfer.py``). Importing a module here imports vLLM."""
