"""Print the four-GPU refit sweep (benchmarks/four_gpus_refit.sh) as one table.

    python3 benchmarks/four_gpus_table.py DIR

DIR holds one ``<run>.jsonl`` per run (the bench's lines, the summary last). Rows:

- non-colocated runs, one row per fan-out (``engine/broadcast``, ``engine/relay``,
  ``engine/direct``): the refit, the transport alone, GB/s per receiver (every engine receives
  the whole model), the run's own 1 GB raw link, and the refit over the 1 → 1 refit's time for
  the same bytes (at its rate: the MoE rows have no 1 → 1 run of their own), target ≤ 1.1;
- colocated runs on 4 GPUs: the refit over its floor (each GPU's ingress of the other ranks'
  bytes plus its own share at device-copy speed, both measured in the run), target ≤ 1.15;
- ``shared_weights`` on one GPU: its GB/s over the device copy's, target ≥ 0.70.

Every row also says whether each refit was verified bit for bit and how many new allocator
segments the timed refits made (sender + receivers).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

RUNS = ("one_to_one", "pp2_vpp2_2to2", "tp2_2to2", "one_to_three", "moe_ep2_2to2",
        "colocated_tp2_pp2_vpp2", "colocated_pp4", "colocated_moe_ep4", "shared_weights")
HEADER = ("run", "fan-out", "refit ms", "transport alone ms", "GB/s per receiver",
          "raw link GB/s", "against", "ratio", "target", "met", "verified", "new segments")


def read(path: Path) -> tuple[dict[str, dict], dict | None]:
    """A run's mode lines by mode, and its summary line."""
    modes, summary = {}, None
    if path.exists():
        for text in path.read_text().splitlines():
            line = json.loads(text)
            if line.get("summary"):
                summary = line
            else:
                modes[line["mode"]] = line
    return modes, summary


def ms(line: dict | None) -> str:
    return f"{line['refit_s_median'] * 1e3:.1f}" if line else "-"


def gbps(line: dict | None) -> str:
    return f"{line['gbps']:.0f}" if line else "-"


def segments(line: dict | None) -> str:
    if not line or line.get("new_segments") is None:
        return "-"
    return f"{line['new_segments']} + {line.get('receiver_new_segments') or 0}"


def verified(*lines: dict | None) -> str:
    found = [line for line in lines if line]
    if any(line.get("error") for line in found):
        return "error: " + next(line["error"] for line in found if line.get("error")
                                ).splitlines()[0][:80]
    return str(all(line.get("verified") is True for line in found)) if found else "-"


def rows(directory: Path) -> list[tuple]:
    table = []
    base_modes, _ = read(directory / "one_to_one.jsonl")
    base = base_modes.get("engine") or base_modes.get("engine/broadcast")
    base_rate = base["payload_bytes"] / base["refit_s_median"] if base else None
    for run in RUNS:
        modes, summary = read(directory / f"{run}.jsonl")
        if not modes:
            table.append((run, "-", "-", "-", "-", "-", "-", "-", "-", "-", "not run", "-"))
            continue
        link = modes.get("raw_link")
        if run == "shared_weights":
            shared = modes.get("shared_weights")
            ratio = shared["gbps"] / link["gbps"] if shared and link else None
            table.append((run, "-", ms(shared), "-", gbps(shared), f"{gbps(link)} (D2D)",
                          "device copy GB/s", _ratio(ratio), "≥ 0.70",
                          _met(ratio, lambda r: r >= 0.70), verified(shared), segments(shared)))
            continue
        fanouts = sorted({name.split("/")[1] for name in modes if "/" in name}) or [None]
        for fanout in fanouts:
            suffix = f"/{fanout}" if fanout else ""
            engine, alone = modes.get("engine" + suffix), modes.get("transport_alone" + suffix)
            if run.startswith("colocated"):
                check = (summary or {}).get("targets", {}).get("refit_vs_floor")
                ratio = check["ratio"] if check else None
                against = f"floor {check['floor_s'] * 1e3:.1f} ms" if check else "floor -"
                target, met = "≤ 1.15", _met(ratio, lambda r: r <= 1.15)
            else:
                ratio = (engine["refit_s_median"] * base_rate / engine["payload_bytes"]
                         if engine and base_rate and run != "one_to_one" else None)
                against, target = "1 → 1 at its rate", "≤ 1.10"
                met = _met(ratio, lambda r: r <= 1.10)
            table.append((run, fanout or "-", ms(engine), ms(alone), gbps(engine), gbps(link),
                          against, _ratio(ratio), target, met, verified(engine, alone),
                          segments(engine)))
    return table


def _ratio(ratio: float | None) -> str:
    return f"{ratio:.3f}" if ratio is not None else "-"


def _met(ratio: float | None, test) -> str:
    return "-" if ratio is None else ("yes" if test(ratio) else "NO")


def main(directory: str) -> None:
    print("| " + " | ".join(HEADER) + " |")
    print("|" + " --- |" * len(HEADER))
    for row in rows(Path(directory)):
        print("| " + " | ".join(str(cell) for cell in row) + " |")


if __name__ == "__main__":
    main(sys.argv[1])
