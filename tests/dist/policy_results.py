"""Launching the policy scenarios and comparing their result files (shared by CPU and GPU tests)."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.launch import REPO_ROOT
from tests.ranks import run_script

SCENARIOS = REPO_ROOT / "tests" / "dist" / "scenarios"


def run_parity(*, hf_path: Path, out_dir: Path, nproc: int, layouts: list[str],
               clip_layouts: list[str] = (), dtypes: list[str] = ("float32",),
               tied_hf_path: Path | None = None, tied_layouts: list[str] = (),
               temperature_layouts: list[str] = (), timeout_s: float = 600) -> str:
    """Run policy_parity.py; the result files land in ``out_dir``. Returns its stdout."""
    args = ["--hf-path", str(hf_path), "--out-dir", str(out_dir), "--layouts", *layouts,
            "--dtypes", *dtypes]
    if clip_layouts:
        args += ["--clip-layouts", *clip_layouts]
    if tied_layouts:
        args += ["--tied-hf-path", str(tied_hf_path), "--tied-layouts", *tied_layouts]
    if temperature_layouts:
        args += ["--temperature-layouts", *temperature_layouts]
    result = run_script(SCENARIOS / "policy_parity.py", *args, nproc=nproc, timeout_s=timeout_s)
    return result.stdout


def load(path: Path) -> dict:
    return torch.load(path, weights_only=False)


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b), sorted(set(a) ^ set(b))
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    assert set(a) == set(b), sorted(set(a) ^ set(b))
    return all(torch.equal(a[k], b[k]) for k in a)


def step_values(run: dict, key: str) -> list[float]:
    return [step[key] for step in run["steps"]]


def relative_diffs(a: list[float], b: list[float]) -> list[float]:
    return [abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True)]


def parity_figures(run: dict, reference: dict) -> dict:
    """How far ``run`` is from ``reference`` (same steps, same data), for asserts and reports."""
    return {
        "loss_rel": max(relative_diffs(step_values(run, "loss"), step_values(reference, "loss"))),
        "grad_norm_rel": max(relative_diffs(step_values(run, "grad_norm"),
                                            step_values(reference, "grad_norm"))),
        "weights_max_abs": max_abs_diff(run["weights"], reference["weights"]),
        "weights_bitwise": bitwise_equal(run["weights"], reference["weights"]),
        "logprobs_initial_max_abs": (run["logprobs_initial"]
                                     - reference["logprobs_initial"]).abs().max().item(),
        "logprobs_final_max_abs": (run["logprobs_final"]
                                   - reference["logprobs_final"]).abs().max().item(),
        "losses_bitwise": step_values(run, "loss") == step_values(reference, "loss"),
    }


def assert_within(figures: dict, bounds: dict[str, float]) -> None:
    """Each figure named in ``bounds`` is at most its bound; the message lists every one over it."""
    over = {name: (figures[name], bound) for name, bound in bounds.items()
            if not figures[name] <= bound}  # NaN is over
    assert not over, f"over bound (figure, bound): {over}; all figures: {figures}"


def hf_logprobs(hf_path: Path, tokens: torch.Tensor, lengths: torch.Tensor, *,
                temperature: float) -> torch.Tensor:
    """Token-aligned logprobs from the Hugging Face model (fp32): the independent reference."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=tokens).logits.float() / temperature
    label_logprobs = torch.log_softmax(logits[:, :-1], dim=-1).gather(
        -1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)
    out = torch.zeros(tokens.shape, dtype=torch.float32)
    out[:, 1:] = label_logprobs
    positions = torch.arange(tokens.shape[1]).unsqueeze(0)
    return torch.where(positions < lengths.unsqueeze(1), out, 0.0)
