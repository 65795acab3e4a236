"""The GRPO application: a training loop that refits an inference engine after every step.

Above the core (model, pipeline, policy, refit, inference), which never imports it:

- ``config.py``    the job's YAML sections (model, parallel, policy, refit, inference, task, grpo,
                   run) and their cross-checks;
- ``loop.py``      generate → score → train → refit, every step; checkpoints, resume;
- ``rundir.py``    the run directory: one run per directory, atomic checkpoints, resume state;
- ``job.py``       launch checks, process groups, the trainer and rollouts of a job;
- ``protocol.py``  the ``Rollouts`` protocol: the only calls the loop makes to where rollouts come
                   from (generate, release, refit, close);
- ``rollouts.py``  its two backends: engines colocated with the trainer ranks, or dedicated
                   inference ranks of a non-colocated job;
- ``seeds.py``     per-step sampling seeds derived from ``run.seed`` (bit-identical resume);
- ``metrics.py``   metrics.jsonl, TensorBoard, optional wandb, the resolved config.yaml;
- ``console.py``   the terminal: one progress bar and a summary line every N steps;
- ``plot.py``      metrics.png: reward (train/eval), refit time and mult_err per step;
- ``batch.py``     completions → the policy's token batch (response mask, sampler logprobs);
- ``tasks.py``     prompts with verifiable answers, and their rewards;
- ``loss.py``      group-normalised advantages, the clipped policy-gradient loss, diagnostics.
"""
