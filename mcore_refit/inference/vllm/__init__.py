"""vLLM as the inference engine (``inference.engine: vllm``).

- :mod:`.engine`: :class:`~mcore_refit.inference.vllm.engine.VllmEngine`, a vLLM ``LLM`` with the
  embedded engine's interface (sampling, logprobs of the temperature-scaled distribution, memory
  release, a seed per call), and the one place that sets the process environment for vLLM;
- :mod:`.transfer`: :class:`~mcore_refit.inference.vllm.transfer.VllmWeightTransfer`, the refit's
  trainer-facing control surface over vLLM's weight-transfer calls; :mod:`.backend` the backend
  inside vLLM's worker, :mod:`.loader`, :mod:`.staging`, :mod:`.verification` its parts.

Importing this package or :mod:`.engine` does not import vLLM (the engine does when it is built);
the other modules import vLLM.
"""
