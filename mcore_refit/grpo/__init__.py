"""The GRPO application: a training loop that refits an inference engine after every step.

Above the core (model, pipeline, policy, refit, inference), which never imports it:

- ``config.py``    the job's YAML sections (model, parallel, policy, refit, inference, task, grpo,
                   run) and their cross-checks;
- ``loop.py``      generate → score → train → refit, every step; metrics, checkpoints, resume;
- ``rollouts.py``  where completions come from: engines colocated with the trainer ranks, or
                   dedicated inference ranks of a split job (the same three calls for both);
- ``batch.py``     completions → the policy's token batch (response mask, sampler logprobs);
- ``tasks.py``     prompts with verifiable answers, and their rewards;
- ``loss.py``      group-normalised advantages, the clipped policy-gradient loss, diagnostics.
"""
