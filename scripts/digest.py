"""Print the refit benchmark's JSON lines compactly: one line per mode, the targets per run.

    python3 scripts/digest.py BENCH.jsonl [...]
"""

import json
import sys

FIELDS = ("refit_s_median", "gbps", "verified", "num_tensors", "num_sources", "held_bytes",
          "peak_extra_bytes", "new_allocations", "new_segments", "receiver_new_segments")

for path in sys.argv[1:]:
    for text in open(path):
        line = json.loads(text)
        where = f"{line.get('source')} {line.get('placement')} {line.get('layout')}"
        if line.get("summary"):
            print("SUMMARY", where, json.dumps(line["targets"]), "all_verified",
                  line["all_verified"])
        else:
            values = " ".join(f"{k}={line.get(k)}" for k in FIELDS)
            error = (line.get("error") or "")[-300:]
            print(f"{line['mode']:>20} {where} {values} phases={line['phases']} "
                  f"receiver={line['receiver_phases']} {error}")
