"""Print the refit benchmark's JSON lines compactly: one line per mode, the targets per run.

    python3 benchmarks/digest.py BENCH.jsonl [...]
"""

import json
import sys

FIELDS = ("refit_s_median", "gbps", "verified", "num_tensors", "num_sources", "held_bytes",
          "peak_extra_bytes", "new_allocations", "new_segments", "receiver_new_segments")


def digest(line: dict) -> str:
    """One bench line (a mode's result or a run's summary) as one line of text."""
    where = f"{line.get('source')} {line.get('placement')} {line.get('layout')}"
    if line.get("summary"):
        return f"SUMMARY {where} {json.dumps(line['targets'])} all_verified {line['all_verified']}"
    values = " ".join(f"{key}={line.get(key)}" for key in FIELDS)
    error = (line.get("error") or "")[-300:]
    return (f"{line['mode']:>20} {where} {values} phases={line['phases']} "
            f"receiver={line['receiver_phases']} {error}")


def main(paths: list[str]) -> None:
    for path in paths:
        with open(path) as lines:
            for text in lines:
                print(digest(json.loads(text)))


if __name__ == "__main__":
    main(sys.argv[1:])
