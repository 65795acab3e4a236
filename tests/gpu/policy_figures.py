"""What the GPU policy tests share: their dtypes and bounds, the ``FIGURES`` report line, and the
check of a run against its reference layout."""

from __future__ import annotations

import json

import torch

from tests.dist.policy_results import assert_within, parity_figures, step_values

DTYPES = ("float32", "bfloat16")
# Largest accepted difference to the reference layout after three Adam steps at lr 1e-3 (GPU
# kernels may pick other algorithms per launch, so bitwise equality is reported, not asserted).
BOUNDS = {
    "float32": {"loss_rel": 1e-5, "grad_norm_rel": 1e-5, "weights_max_abs": 1e-4,
                "logprobs_final_max_abs": 1e-4},
    "bfloat16": {"loss_rel": 2e-3, "grad_norm_rel": 1e-2, "weights_max_abs": 1e-2,
                 "logprobs_final_max_abs": 5e-2},
}


def report(name: str, figures: dict) -> None:
    print(f"FIGURES {name} {json.dumps(figures, sort_keys=True)}", flush=True)


def check_against_reference(name: str, run: dict, reference: dict, *, labels: tuple[str, str],
                            dtype: str) -> None:
    """Report ``run`` against ``reference`` (``labels`` name the two layouts) as one ``FIGURES``
    line, assert the dtype's bounds, and assert that swapping the reference model in and out left
    the run's logprobs bitwise as they were."""
    figures = parity_figures(run, reference)
    figures["losses"] = step_values(run, "loss")
    figures["grad_norms"] = step_values(run, "grad_norm")
    figures["seconds"] = {labels[0]: run["seconds"], labels[1]: reference["seconds"]}
    report(name, figures)
    assert_within(figures, BOUNDS[dtype])
    assert torch.equal(run["reference_logprobs_final"], run["logprobs_initial"])
    assert torch.equal(run["logprobs_after_reference"], run["logprobs_final"])
