"""Start-up checks of the model's files and of the data against the model: what would otherwise
fail deep inside the start-up or the first steps (``incomplete metadata`` while loading,
``IndexError`` inside generation, steps a hundred times slower) fails in seconds, naming the file
or the problem and the key.

    check_model_and_data(config)    # every rank, before the start-up (job.validate_launch)
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from mcore_refit.config import ConfigError
from mcore_refit.files import CorruptFile, check_checkpoint_directory
from mcore_refit.grpo.config import GRPOJobConfig
from mcore_refit.grpo.evaluation import EVAL_SEED_OFFSET, draw_eval_set
from mcore_refit.grpo.tasks import Problem, excerpt, load_jsonl_problems

# Problems of a generated (arithmetic) task measured at start-up; the engine checks every prompt.
GENERATED_SAMPLE = 256


def check_model_and_data(config: GRPOJobConfig) -> None:
    """For a local ``model.hf_path``: whole safetensors files, a tokenizer whose ids fit the
    model's vocabulary, and prompts (``task``, ``eval``) that leave room for
    ``inference.sampling.max_new_tokens`` within the model's positions."""
    hf_path = Path(config.model.hf_path)
    if not hf_path.is_dir():
        return  # from the Hub (model.allow_hub): nothing local to check
    if config.model.load_weights:
        try:
            check_checkpoint_directory(hf_path)
        except CorruptFile as error:
            raise ConfigError(f"`model.hf_path`: {error}") from None
    try:
        model = json.loads((hf_path / "config.json").read_text())
    except FileNotFoundError:
        raise ConfigError(f"`model.hf_path`={str(hf_path)!r} is not a Hugging Face checkpoint "
                          "(no config.json)") from None
    except (OSError, ValueError) as error:
        raise ConfigError(f"`model.hf_path`: cannot read {hf_path / 'config.json'} "
                          f"({type(error).__name__}: {error})") from None
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(hf_path))
    vocab_size = model.get("vocab_size")
    if isinstance(vocab_size, int) and len(tokenizer) > vocab_size:
        raise ConfigError(
            f"`model.hf_path`: the tokenizer has {len(tokenizer)} tokens but the model's "
            f"vocabulary holds {vocab_size} (vocab_size in {hf_path / 'config.json'}): token "
            "ids from the tokenizer would index past the embedding; use the model's own "
            "tokenizer")
    positions = model.get("max_position_embeddings")
    if not isinstance(positions, int):
        return
    budget = config.inference.sampling.max_new_tokens
    for key, problems in _prompt_sets(config):
        lengths = [len(ids) for ids in tokenizer([p.prompt for p in problems],
                                                 add_special_tokens=False)["input_ids"]]
        index = max(range(len(lengths)), key=lengths.__getitem__, default=None)
        if index is not None and lengths[index] + budget > positions:
            raise ConfigError(
                f"`{key}`: a prompt ({excerpt(problems[index].prompt)}) is {lengths[index]} "
                f"tokens; with `inference.sampling.max_new_tokens`={budget} it needs "
                f"{lengths[index] + budget} positions, more than the model's {positions} "
                f"(max_position_embeddings in {hf_path / 'config.json'}): shorten the prompts "
                "or lower `inference.sampling.max_new_tokens`")


def _prompt_sets(config: GRPOJobConfig) -> list[tuple[str, Sequence[Problem]]]:
    """The prompts of ``task`` (every line of a jsonl file, else a sample) and of ``eval``."""
    task_config = config.task
    task = task_config.build(seed=config.run.seed, hf_path=config.model.hf_path)
    count = (len(load_jsonl_problems(task_config.path, prompt_key=task_config.prompt_key,
                                     answer_key=task_config.answer_key))
             if task_config.kind == "jsonl" else GENERATED_SAMPLE)
    sets = [("task", task.sample(count))]
    if config.eval is not None:
        sets.append(("eval", draw_eval_set(config.eval, seed=config.run.seed + EVAL_SEED_OFFSET,
                                           hf_path=config.model.hf_path)))
    return sets
