"""Typed configuration: frozen keyword-only dataclasses and the one loader that builds them.

Every config section is a frozen ``kw_only`` dataclass that validates its own values in
``__post_init__``. A section does not know where it is nested (``parallel`` or
``megatron.parallel``), so it raises :class:`ConfigError` with its keys written in backticks,
relative to itself (```lr` must be positive``); :func:`from_dict`, which knows the path, renders
them as full dotted keys (``policy.optimizer.lr must be positive``). :func:`from_dict` builds a
section (and its nested sections) from plain data and rejects unknown keys by their dotted path;
a section's ``RENAMED_KEYS`` turn an old key into an error naming its new one.
:func:`load_config` reads YAML and applies ``key.sub=value`` overrides; :func:`save_config` writes
a config back as YAML (every key resolved). Recipes compose sections
into their own top-level dataclass and call :func:`load_config`; nothing else parses YAML.
"""

from __future__ import annotations

import dataclasses
import decimal
import re
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
    """A bad config value; keys in the message are written in backticks, relative to the section
    that raised it (```pipeline` must be ≥ 1``). ``str()`` shows them as dotted keys."""

    _KEY = re.compile(r"`([A-Za-z_][A-Za-z0-9_.\[\]]*)`")

    def __init__(self, template: str) -> None:
        self.template = template
        super().__init__(self._KEY.sub(r"\1", template))

    def at(self, path: str) -> ConfigError:
        """The same error for a section found at ``path`` (its keys prefixed with it)."""
        if not path:
            return self
        return ConfigError(self._KEY.sub(lambda m: f"`{path}.{m.group(1)}`", self.template))


Dtype = Literal["float32", "bfloat16", "float16"]
LayerSpec = Literal["auto", "te", "local"]


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """Model-parallel layout. Data parallelism is what remains of the world size."""

    tensor: int = 1
    pipeline: int = 1
    # Model chunks per pipeline rank (interleaved schedule); None means not interleaved.
    virtual_pipeline: int | None = None
    sequence_parallel: bool = False
    # Expert-parallel size (mixture-of-experts models): each rank of an expert-parallel group
    # holds 1/expert of every MoE layer's experts. Carved out of the data-parallel ranks.
    expert: int = 1

    def __post_init__(self) -> None:
        _require_positive("tensor", self.tensor)
        _require_positive("pipeline", self.pipeline)
        _require_positive("expert", self.expert)
        if self.virtual_pipeline is not None:
            _require_positive("virtual_pipeline", self.virtual_pipeline)
            if self.pipeline == 1:
                raise ConfigError(
                    f"`virtual_pipeline`={self.virtual_pipeline} needs `pipeline` > 1; set "
                    "`virtual_pipeline`: null or raise `pipeline`")
        if self.sequence_parallel and self.tensor == 1:
            raise ConfigError("`sequence_parallel`=true needs `tensor` > 1; set "
                              "`sequence_parallel`: false")

    @property
    def num_model_chunks(self) -> int:
        """Model chunks held by each rank (the virtual pipeline size, or 1)."""
        return self.virtual_pipeline if self.virtual_pipeline is not None else 1

    @property
    def model_parallel_size(self) -> int:
        return self.tensor * self.pipeline

    def data_parallel_size(self, world_size: int) -> int:
        """The data-parallel size for ``world_size`` ranks; raises if the layout does not fit.

        Expert parallelism splits the data-parallel ranks (Megatron-Core's expert groups span
        tensor × expert ranks per pipeline stage), so ``world_size`` must also be a multiple of
        tensor × pipeline × expert.
        """
        if world_size % self.model_parallel_size != 0:
            raise ValueError(
                f"world size {world_size} is not divisible by parallel.tensor × "
                f"parallel.pipeline = {self.tensor} × {self.pipeline}; launch a multiple of "
                f"{self.model_parallel_size} ranks or change the layout"
            )
        expert_size = self.model_parallel_size * self.expert
        if world_size % expert_size != 0:
            raise ValueError(
                f"world size {world_size} is not divisible by parallel.tensor × "
                f"parallel.pipeline × parallel.expert = {self.tensor} × {self.pipeline} × "
                f"{self.expert}; launch a multiple of {expert_size} ranks or lower "
                "parallel.expert"
            )
        return world_size // self.model_parallel_size

    def validate_for_model(self, *, world_size: int, num_layers: int, num_attention_heads: int,
                           num_query_groups: int, num_experts: int | None = None) -> None:
        """Reject layouts the model cannot be split into, before any model is built.

        ``num_experts`` is the experts per MoE layer (None for a dense model).
        """
        self.data_parallel_size(world_size)
        if self.expert > 1 and num_experts is None:
            raise ValueError(f"parallel.expert={self.expert} needs a mixture-of-experts model; "
                             "this one has no experts (set parallel.expert: 1)")
        if num_experts is not None and num_experts % self.expert != 0:
            raise ValueError(f"parallel.expert={self.expert} must divide the model's "
                             f"{num_experts} experts per layer")
        if num_experts is not None and self.tensor > 1 and not self.sequence_parallel:
            raise ValueError(
                f"a mixture-of-experts model at parallel.tensor={self.tensor} needs "
                "parallel.sequence_parallel: true (megatron-core's MoELayer requires it with "
                "tensor parallelism), and sequence parallelism needs the transformer-engine "
                "layer spec")
        num_stages = self.pipeline * self.num_model_chunks
        if num_layers % num_stages != 0:
            if self.virtual_pipeline is None:
                split = f"parallel.pipeline = {num_stages} stages"
            else:
                split = (f"parallel.pipeline × parallel.virtual_pipeline = {self.pipeline} × "
                         f"{self.virtual_pipeline} = {num_stages} stages")
            raise ValueError(
                f"the model's {num_layers} layers do not divide into {split}; "
                f"choose sizes whose product divides {num_layers}"
            )
        if num_attention_heads % self.tensor != 0 or num_query_groups % self.tensor != 0:
            raise ValueError(
                f"parallel.tensor={self.tensor} must divide the model's {num_attention_heads} "
                f"attention heads and {num_query_groups} key/value heads"
            )


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Which model to build and how."""

    # Directory of a Hugging Face checkpoint (config.json + safetensors).
    hf_path: str
    # Parameter dtype of the Megatron model (fp32 master weights are the optimizer's business).
    dtype: Dtype = "float32"
    # Transformer layer spec: "te" requires transformer-engine, "auto" uses it when it imports.
    layer_spec: LayerSpec = "auto"
    # False builds the architecture with random weights instead of loading the checkpoint's.
    load_weights: bool = True
    # Mixture-of-experts models: the router's load-balancing loss coefficient (Megatron's
    # moe_aux_loss_coeff). 0 trains exactly the HF model's objective, which the export verifier's
    # gradient parity needs; the bridges' default (1e-3) gave huge grad norms on tiny models.
    moe_aux_loss_coeff: float = 0.0
    # True lets an `hf_path` that is not a local directory be downloaded from the Hugging Face
    # Hub (a typo would otherwise train another model than meant, or stall without a network).
    allow_hub: bool = False

    def __post_init__(self) -> None:
        if not self.hf_path:
            raise ConfigError("`hf_path` must name a Hugging Face checkpoint directory")
        if not self.moe_aux_loss_coeff >= 0:
            raise ConfigError(f"`moe_aux_loss_coeff` must be ≥ 0, got {self.moe_aux_loss_coeff}")

    def check_local(self) -> None:
        """Refuse an ``hf_path`` that is not a local directory unless ``allow_hub`` is set.

        Not part of validation (a config may name a path of another machine); jobs call it
        before they build anything.
        """
        if not self.allow_hub and not Path(self.hf_path).is_dir():
            raise ConfigError(
                f"`hf_path`={self.hf_path!r} is not a local directory (resolved from "
                f"{str(Path.cwd())!r}); give the path of a Hugging Face checkpoint, or set "
                "`allow_hub`: true to download it from the Hugging Face Hub")

    @property
    def torch_dtype(self):
        import torch

        return getattr(torch, self.dtype)


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


def from_dict[T](cls: type[T], data: Any, *, path: str = "") -> T:
    """Build the dataclass ``cls`` from plain data, recursing into nested dataclass fields.

    Raises :class:`ConfigError` naming the dotted key for unknown, renamed and missing keys,
    values of the wrong type, and values a section rejects.
    """
    where = path if path else "the config"
    if isinstance(data, cls):
        return data
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must be a mapping, got {type(data).__name__}: {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    renamed = getattr(cls, "RENAMED_KEYS", {})
    for old in sorted(set(data) & set(renamed)):
        raise ConfigError(f"config key '`{old}`' was renamed '`{renamed[old]}`'").at(path)
    unknown = sorted(set(data) - set(fields))
    if unknown:
        key = _join(path, str(unknown[0]))
        raise ConfigError(f"unknown config key '{key}' (known keys: {', '.join(sorted(fields))})")
    kwargs = {}
    for name, field in fields.items():
        key = _join(path, name)
        if name in data:
            kwargs[name] = _convert(hints[name], data[name], key)
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise ConfigError(f"missing required config key '{key}'")
    try:
        return cls(**kwargs)
    except ConfigError as error:
        # Errors of nested sections were rendered at their own path while converting kwargs;
        # only this section's own validation reaches here.
        raise error.at(path) from None


def load_config[T](cls: type[T], path: str | Path | None = None,
                overrides: typing.Sequence[str] = ()) -> T:
    """Read YAML from ``path`` (or start from ``cls``'s defaults), apply overrides, build ``cls``.

    Overrides are ``dotted.key=value`` strings; the value is parsed as YAML (``3``, ``true``,
    ``null``, ``[1, 2]``). Numbers in exponent notation (``1e-5``, ``1E5``) are numbers wherever a
    key is typed as one, in the file and in overrides (YAML 1.2's reading, not PyYAML's 1.1).
    """
    return from_dict(cls, _read_with_overrides(path, overrides))


def load_section[T](cls: type[T], path: str | Path | None, overrides: typing.Sequence[str],
                    section: str) -> T:
    """Build ``cls`` from one top-level ``section`` of what :func:`load_config` reads, ignoring
    the others: errors name keys as ``section.key``. For what must be known before the whole
    config can be built (its sections import heavy modules)."""
    data = _read_with_overrides(path, overrides).get(section, {})
    return from_dict(cls, data, path=section)


def _read_with_overrides(path: str | Path | None, overrides: typing.Sequence[str]) -> dict:
    data: dict[str, Any] = {}
    if path is not None:
        loaded = _read_yaml(Path(path))
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{path}: the top level of a config file must be a mapping")
        data = loaded if loaded is not None else {}
    for override in overrides:
        _apply_override(data, override)
    return data


def to_dict(config: Any) -> Any:
    """The plain data (mappings, lists, scalars) :func:`from_dict` builds ``config`` back from."""
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return {f.name: to_dict(getattr(config, f.name))
                for f in dataclasses.fields(config) if f.init}
    if isinstance(config, (list, tuple)):
        return [to_dict(item) for item in config]
    if isinstance(config, dict):
        return {key: to_dict(value) for key, value in config.items()}
    return config


def save_config(config: Any, path: str | Path) -> None:
    """Write ``config`` (every key, defaults included) as YAML that :func:`load_config` reads
    back into an equal config; the folder is created."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(to_dict(config), sort_keys=False))


class _StrictLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the last)."""

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, Any] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                first = seen[key]
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first given on line {first.line + 1})",
                    key_node.start_mark)
            seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


def _read_yaml(path: Path) -> Any:
    """Parse ``path``; syntax errors and duplicate keys name the file, line and column."""
    text = path.read_text()
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        problem = " ".join(part for part in (error.context, error.problem) if part)
        raise ConfigError(f"{where}: {problem}") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: {error}") from None


def _apply_override(data: dict[str, Any], override: str) -> None:
    key, sep, raw = override.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {override!r} must look like key.sub=value")
    node = data
    parts = key.split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {override!r}: '{part}' is not a config section")
        node = child
    try:
        node[parts[-1]] = yaml.load(raw, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader
    except yaml.MarkedYAMLError as error:
        problem = " ".join(part for part in (error.context, error.problem) if part)
        raise ConfigError(f"override {override!r}: {problem}") from None


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _convert(hint: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None:
            if type(None) in options:
                return None
            raise ConfigError(f"config key '{key}' must not be null")
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _convert(option, value, key)
            except ConfigError as error:
                errors.append(str(error))
        raise ConfigError(errors[0] if len(errors) == 1 else
                         f"config key '{key}' has invalid value {value!r}")
    if origin is Literal:
        allowed = typing.get_args(hint)
        if value not in allowed:
            raise ConfigError(
                f"config key '{key}' must be one of {', '.join(map(repr, allowed))}, got {value!r}"
            )
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"config key '{key}' must be a list, got {value!r}")
        (item_hint, *_) = typing.get_args(hint) or (Any,)
        items = [_convert(item_hint, item, f"{key}[{i}]") for i, item in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if dataclasses.is_dataclass(hint):
        return from_dict(hint, value, path=key)
    if hint is Any:
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"config key '{key}' must be true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, str) and _EXPONENT_NUMBER.match(value):
            value = _exact_int(value, key)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"config key '{key}' must be an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, str) and _EXPONENT_NUMBER.match(value):
            return float(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"config key '{key}' must be a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"config key '{key}' must be a string, got {value!r}")
        return value
    raise TypeError(f"config key '{key}': unsupported annotation {hint!r}")


# The numbers YAML 1.2 reads as floats that PyYAML's YAML 1.1 leaves as strings: a mantissa
# without a dot or an exponent without a sign (``1e-5``, ``2E3``, ``1e5``; YAML 1.1 wants
# ``1.0e-5``). Only a field typed as a number reads them as one; a string field keeps the text.
_EXPONENT_NUMBER = re.compile(r"^[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)[eE][-+]?[0-9]+$")


def _exact_int(text: str, key: str) -> int:
    """``1e5`` for an integer key: the integer it denotes exactly, or an error (``1.5e0``)."""
    number = decimal.Decimal(text)
    if number.adjusted() > 18:  # int() of 1e999999999 would build a billion digits
        raise ConfigError(f"config key '{key}' must be an integer, got {text!r} (too large)")
    if number != number.to_integral_value():
        raise ConfigError(f"config key '{key}' must be an integer, got {text!r} (= {number:f})")
    return int(number)


def _require_positive(key: str, value: int) -> None:
    """``key`` is relative to the section that checks it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"`{key}` must be a positive integer, got {value!r}")
