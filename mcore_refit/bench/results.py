"""The benchmark's results: one JSON line per mode, and the summary line with the targets."""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mcore_refit.bench.config import TargetsConfig
from mcore_refit.control import Outcome, is_consequential
from mcore_refit.refit import RefitTelemetry

PHASES = ("export_s", "pack_s", "transfer_s", "load_s", "wait_s", "checksum_s")


@dataclass
class ModeResult:
    """One JSON line of the benchmark."""

    mode: str
    payload_bytes: int
    refit_s: list[float]
    device: str
    verified: bool | None = None
    num_tensors: int | None = None
    num_buffers: int | None = None
    num_sources: int | None = None
    held_bytes: int | None = None
    # Memory a receiving rank holds for refits (its slots; vLLM: the staging), the largest.
    receiver_held_bytes: int | None = None
    largest_tensor_bytes: int | None = None
    phases: dict[str, float] = field(default_factory=dict)
    receiver_phases: dict[str, float] = field(default_factory=dict)
    # The receiving engine's own figures (telemetry's ``engine``: vLLM's loader), medians.
    receiver_engine: dict[str, float] = field(default_factory=dict)
    peak_extra_bytes: int | None = None
    receiver_peak_extra_bytes: int | None = None
    new_allocations: int | None = None
    new_segments: int | None = None
    receiver_new_allocations: int | None = None
    receiver_new_segments: int | None = None
    error: str | None = None
    # Non-colocated refit modes: how buffers reached the inference ranks (refit.transport.fanout).
    fanout: str | None = None
    # Colocated raw link with several ranks: each GPU's ingress over its links (an all-gather).
    ingress_gbps: float | None = None
    # Refit modes: the payload bytes each source rank sends (the floor's local shares).
    source_bytes: list[int] | None = None

    @property
    def refit_s_median(self) -> float:
        return statistics.median(self.refit_s) if self.refit_s else float("nan")

    @property
    def gbps(self) -> float:
        median = self.refit_s_median
        return self.payload_bytes / median / 1e9 if median > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["refit_s_median"] = round(self.refit_s_median, 6)
        data["gbps"] = significant(self.gbps)
        data["refit_s"] = [round(s, 6) for s in self.refit_s]
        return {"mode": data.pop("mode"), **data}


def transport_result(mode: str, plan, sender: list[RefitTelemetry], receiver: list[dict], *,
                     verified: bool | None, device: str, error: str | None) -> ModeResult:
    """Fold the timed refits' telemetry of both ends into one result."""
    result = ModeResult(mode=mode, payload_bytes=plan.payload_bytes, device=device,
                        refit_s=[t.total_s for t in sender], verified=verified,
                        num_tensors=plan.num_tensors, num_buffers=plan.num_buffers,
                        num_sources=len(plan.sources),
                        held_bytes=max((t.held_bytes for t in sender), default=None),
                        largest_tensor_bytes=plan.largest_tensor_bytes, error=error,
                        source_bytes=[sum(b.wire_bytes for b in plan.buffers if b.source == s)
                                      for s in plan.sources])
    if sender:
        result.phases = {p: round(statistics.median(getattr(t, p) for t in sender), 6)
                         for p in PHASES}
    if receiver:
        result.receiver_phases = {p: round(statistics.median(t[p] for t in receiver), 6)
                                  for p in PHASES}
        result.receiver_engine = median_by_key(t.get("engine", {}) for t in receiver)
    result.peak_extra_bytes = _max(t.peak_extra_bytes for t in sender)
    result.new_allocations = _sum(t.new_allocations for t in sender)
    result.new_segments = _sum(t.new_segments for t in sender)
    result.receiver_held_bytes = _max(t["held_bytes"] for t in receiver)
    result.receiver_peak_extra_bytes = _max(t["peak_extra_bytes"] for t in receiver)
    result.receiver_new_allocations = _sum(t["new_allocations"] for t in receiver)
    result.receiver_new_segments = _sum(t["new_segments"] for t in receiver)
    return result


def floor_result(mode: str, rows: list[list], *, device: str) -> ModeResult:
    """vLLM's load floor from every loading rank's ``[seconds per timed repetition, bytes, the
    loader's figures per timed repetition]``: the slowest rank's time per repetition, and the
    figures' medians over ranks and repetitions."""
    return ModeResult(mode=mode, payload_bytes=rows[0][1],
                      refit_s=[max(times) for times in zip(*(row[0] for row in rows))],
                      receiver_engine=median_by_key(f for row in rows for f in row[2]),
                      device=device)


def pool_rounds(results: list[ModeResult]) -> list[ModeResult]:
    """One result per mode from those of every round (``bench.rounds``), in the order the modes
    first ran: the timed repetitions of all rounds together; phases and engine figures, the
    median of the rounds' medians; bytes, the largest; allocations, summed; every round's
    error, with its round."""
    by_mode: dict[str, list[ModeResult]] = {}
    for result in results:
        by_mode.setdefault(result.mode, []).append(result)
    return [_pooled(rounds) if len(rounds) > 1 else rounds[0] for rounds in by_mode.values()]


def _pooled(rounds: list[ModeResult]) -> ModeResult:
    verified = [r.verified for r in rounds]
    errors = [f"round {i + 1} of {len(rounds)}: {r.error}"
              for i, r in enumerate(rounds) if r.error]
    ingress = [r.ingress_gbps for r in rounds if r.ingress_gbps is not None]
    return dataclasses.replace(
        rounds[0], refit_s=[s for r in rounds for s in r.refit_s],
        verified=False if False in verified else (True if True in verified else None),
        held_bytes=_max(r.held_bytes for r in rounds),
        receiver_held_bytes=_max(r.receiver_held_bytes for r in rounds),
        phases=median_by_key(r.phases for r in rounds),
        receiver_phases=median_by_key(r.receiver_phases for r in rounds),
        receiver_engine=median_by_key(r.receiver_engine for r in rounds),
        peak_extra_bytes=_max(r.peak_extra_bytes for r in rounds),
        receiver_peak_extra_bytes=_max(r.receiver_peak_extra_bytes for r in rounds),
        new_allocations=_sum(r.new_allocations for r in rounds),
        new_segments=_sum(r.new_segments for r in rounds),
        receiver_new_allocations=_sum(r.receiver_new_allocations for r in rounds),
        receiver_new_segments=_sum(r.receiver_new_segments for r in rounds),
        error="\n".join(errors) or None,
        ingress_gbps=round(statistics.median(ingress), 3) if ingress else None)


def median_by_key(figures) -> dict[str, float]:
    """Key by key, the median over the dicts in ``figures`` that have the key."""
    figures = list(figures)
    keys = list(dict.fromkeys(key for f in figures for key in f))
    return {key: round(statistics.median(f[key] for f in figures if key in f), 6)
            for key in keys}


def rank_row(telemetry: list[dict], error: BaseException | None) -> dict[str, Any]:
    """What one rank contributes to the end-of-mode gather: its timed refits' telemetry (an
    inference rank's; a trainer rank's is folded locally) and its error, if the mode failed
    there, marked consequential when it only says that a wait broke (:func:`is_consequential`)."""
    return {"telemetry": telemetry,
            "error": Outcome.failed(error).error if error is not None else None,
            "consequential": error is not None and is_consequential(error)}


def fold_rows(gathered: list[Any], *, mode: str,
              name_of: Callable[[int], str]) -> tuple[list[dict], str | None]:
    """The inference ranks' telemetry and the mode's error from the end-of-mode gather over
    every rank (:func:`rank_row` each; ``name_of`` names a rank of the gather).

    The error leads with a root failure, named by its rank (a rank's own error before the
    timeouts and broken waits it caused); a row of another shape (the ranks fell out of step:
    one left an exchange that another was still in) is reported after it, never raised.
    """
    telemetry: list[dict] = []
    causes: list[tuple[bool, str]] = []
    out_of_step: list[str] = []
    for rank, row in enumerate(gathered):
        rows = row.get("telemetry") if isinstance(row, dict) else None
        if not (isinstance(rows, list) and all(isinstance(t, dict) for t in rows)):
            out_of_step.append(f"{name_of(rank)} sent {json.dumps(row)[:200]} where its "
                               "telemetry was due: the ranks fell out of step")
            continue
        telemetry.extend(rows)
        if row.get("error"):
            causes.append((bool(row.get("consequential")), f"{name_of(rank)}: {row['error']}"))
    texts = [text for _, text in sorted(causes, key=lambda cause: cause[0])] + out_of_step
    unique = list(dict.fromkeys(texts))
    if not unique:
        return telemetry, None
    then = "".join(f"\nthen: {text}" for text in unique[1:])
    return telemetry, f"mode {mode} failed on {unique[0]}{then}"


def significant(figure: float) -> float:
    """``figure`` to 4 significant digits: a CPU run's bandwidths are thousandths of a GB/s,
    which a fixed number of decimals would round to 0 (and a ratio of them far off)."""
    return float(f"{figure:.4g}")


def summarize(results: list[ModeResult], *, source: str, placement: str,
              targets: TargetsConfig, alignment_bytes: int) -> dict[str, Any]:
    """The last JSON line: every mode against the link, and the targets it must meet."""
    by_mode = {r.mode: r for r in results}
    link = by_mode.get("raw_link")
    link_gbps = link.gbps if link is not None else None
    modes = {r.mode: {"gbps": significant(r.gbps), "refit_s_median": round(r.refit_s_median, 6),
                      "fraction_of_link": round(r.gbps / link_gbps, 4) if link_gbps else None,
                      "verified": r.verified} for r in results}
    checks: dict[str, Any] = {}
    # One set of refit checks per fan-out (bench.fanouts: engine/broadcast, engine/relay, ...),
    # each against the one vLLM load floor of the run (vllm_load_floor runs once).
    suffixes = list(dict.fromkeys(r.mode[len(r.mode.split("/")[0]):] for r in results))
    for suffix in suffixes:
        found = {mode: by_mode.get(mode + suffix) for mode in
                 ("engine", "transport_alone", "bridge_export", "shared_weights")}
        for key, check in _refit_checks(found, link=link, vllm_floor=by_mode.get("vllm_load_floor"),
                                        source=source, placement=placement, targets=targets,
                                        alignment_bytes=alignment_bytes).items():
            checks[key + suffix.replace("/", "@")] = check
    export, bridge_alone = by_mode.get("export_alone"), by_mode.get("bridge_export_alone")
    if export is not None and bridge_alone is not None:
        checks["export_speedup_over_bridge_export"] = {
            **_at_least(_ratio(bridge_alone.refit_s_median, export.refit_s_median),
                        targets.speedup_over_bridge),
            "export_s": round(export.refit_s_median, 6),
            "bridge_export_s": round(bridge_alone.refit_s_median, 6)}
    return {"summary": True, "source": source, "placement": placement,
            "device": results[0].device if results else None,
            "raw_link_gbps": significant(link_gbps) if link_gbps else None,
            "modes": modes, "targets": checks,
            "all_verified": all(r.verified is not False for r in results)}


def _refit_checks(found: dict[str, ModeResult | None], *, link: ModeResult | None,
                  vllm_floor: ModeResult | None, source: str, placement: str,
                  targets: TargetsConfig, alignment_bytes: int) -> dict[str, Any]:
    """The checks of one fan-out's refit modes (``found``: engine, transport_alone, ...), the
    vLLM load floor's (``vllm_floor``: the run's vllm_load_floor result) among them."""
    checks: dict[str, Any] = {}
    link_gbps = link.gbps if link is not None else None
    engine, transport = found["engine"], found["transport_alone"]
    if engine is not None and link_gbps and source != "megatron":
        if placement == "non_colocated":
            needed = targets.link_fraction
        else:
            needed = (targets.copy_fraction_moe if source == "moe_30b_a3b"
                      else targets.copy_fraction_dense)
        checks["transport_vs_link"] = _at_least(engine.gbps / link_gbps, needed)
    shared = found["shared_weights"]
    if shared is not None and link_gbps and source != "megatron":
        needed = (targets.copy_fraction_moe if source == "moe_30b_a3b"
                  else targets.copy_fraction_dense)
        checks["shared_weights_vs_link"] = _at_least(shared.gbps / link_gbps, needed)
    if engine is not None and transport is not None:
        checks["refit_vs_transport_alone"] = {
            **_at_most(_ratio(engine.refit_s_median, transport.refit_s_median),
                       targets.refit_over_transport),
            "refit_s": round(engine.refit_s_median, 6),
            "transport_s": round(transport.refit_s_median, 6)}
    for name in ("engine", "transport_alone", "shared_weights"):
        refit = found[name]
        if vllm_floor is not None and refit is not None:
            checks[f"{name}_vs_vllm_load_floor"] = {
                **_at_most(_ratio(refit.refit_s_median, vllm_floor.refit_s_median),
                           targets.refit_over_vllm_floor),
                "refit_s": round(refit.refit_s_median, 6),
                "floor_s": round(vllm_floor.refit_s_median, 6)}
    bridge = found["bridge_export"]
    if engine is not None and bridge is not None:
        checks["refit_speedup_over_bridge_export"] = {
            "ratio": round(_ratio(bridge.refit_s_median, engine.refit_s_median), 4)}
    floor = colocated_floor_s(engine, link)
    if floor is not None:
        checks["refit_vs_floor"] = {
            **_at_most(_ratio(engine.refit_s_median, floor), targets.refit_over_floor),
            "refit_s": round(engine.refit_s_median, 6), "floor_s": round(floor, 6)}
    if engine is not None and engine.peak_extra_bytes is not None:
        bound = engine.held_bytes + engine.largest_tensor_bytes + 2 * alignment_bytes
        checks["peak_extra_memory"] = {"bytes": engine.peak_extra_bytes, "bound": bound,
                                       "met": engine.peak_extra_bytes <= bound}
    if engine is not None and engine.new_segments is not None:
        checks["no_new_allocations_after_first_refit"] = {
            "new_allocations": engine.new_allocations, "new_segments": engine.new_segments,
            "receiver_new_allocations": engine.receiver_new_allocations,
            "receiver_new_segments": engine.receiver_new_segments,
            "met": engine.new_segments == 0 and not engine.receiver_new_segments}
    return checks


def colocated_floor_s(engine: ModeResult | None, link: ModeResult | None) -> float | None:
    """The least time a colocated refit on several GPUs can take: on the slowest GPU, the bytes
    of the other ranks' sources over its ingress (``link.ingress_gbps``, an all-gather in the
    same run) plus its own source's bytes at device-copy speed (``link.gbps``). None unless
    both were measured."""
    if engine is None or link is None or not engine.source_bytes or not link.ingress_gbps \
            or link.gbps <= 0:
        return None
    total = sum(engine.source_bytes)
    return max((total - own) / (link.ingress_gbps * 1e9) + own / (link.gbps * 1e9)
               for own in engine.source_bytes)


def emit(line: dict[str, Any], output: str | None) -> None:
    text = json.dumps(line)
    print(text, flush=True)
    if output is not None:
        with open(output, "a") as handle:
            handle.write(text + "\n")


def progress(result: ModeResult) -> None:
    """One line on stderr as each mode ends, so a run cut short still shows how far it got."""
    error = f", error {result.error.splitlines()[0]}" if result.error else ""
    print(f"bench: {result.mode} done: median {result.refit_s_median * 1e3:.2f} ms, verified "
          f"{result.verified}{error}", file=sys.stderr, flush=True)


def _at_least(ratio: float, target: float) -> dict[str, Any]:
    return {"ratio": round(ratio, 4), "target": target, "met": ratio >= target}


def _at_most(ratio: float, target: float) -> dict[str, Any]:
    return {"ratio": round(ratio, 4), "target": target, "met": ratio <= target}


def _ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator > 0 else float("inf")


def _max(values) -> int | None:
    values = [v for v in values if v is not None]
    return max(values) if values else None


def _sum(values) -> int | None:
    values = [v for v in values if v is not None]
    return sum(values) if values else None
