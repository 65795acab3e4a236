"""The Megatron policy worker: train step, logprobs, reference model, offload, checkpoints.

Modules, one job each:
  ``config``      what a YAML file sets (:class:`PolicyConfig` and its sections);
  ``batch``       :class:`SequenceBatch` → padded micro-batches, and results back to batch order;
  ``optim``       Megatron's optimizer and learning-rate scheduler;
  ``reference``   a host copy of the weights that can stand in for the live ones;
  ``offload``     device memory → host and back, keeping every tensor object;
  ``checkpoint``  Megatron distributed checkpointing of chunks, optimizer, scheduler, step;
  ``worker``      :class:`~mcore_refit.policy.worker.Policy` and ``build_policy``, which tie them
                  together (imports Megatron; import it from there).
"""

from mcore_refit.policy.batch import SequenceBatch
from mcore_refit.policy.config import OptimizerConfig, PackingConfig, PolicyConfig

__all__ = ["OptimizerConfig", "PackingConfig", "PolicyConfig", "SequenceBatch"]
