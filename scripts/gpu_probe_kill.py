"""How long a SIGKILLed CUDA process takes to look dead from its parent, and by which sign.

python3 scripts/gpu_probe_kill.py [--gib 1 40]: for each size, a spawned child creates a CUDA
context, allocates that many GiB, maps a CUDA tensor of the parent (CUDA IPC, as a colocated
engine does), says it is ready over a pipe and waits on it (idle) or keeps the GPU busy. The
parent SIGKILLs it and polls every 2 ms until it is reaped, printing one JSON line per case with
the seconds from the kill until each sign first showed:

- ``exiting``: ``/proc/<pid>/stat`` flags carry PF_EXITING (the kernel began the exit);
- ``exit_code``: ``/proc/<pid>/stat`` field 52 is non-zero (the waitpid status, set early);
- ``pipe_eof``: the parent's end of the pipe reads EOF (the child's descriptors were closed);
- ``zombie``: state Z or X;
- ``reaped``: ``Process.is_alive()`` is false (waitpid saw it), what the engine check uses.

On nvidia-h200-x2 (2026-11-26), 1 and 40 GiB, idle and busy: zombie within 2.4 ms, pipe EOF
within 2.5 ms, reaped within 0.11 s. The driver's teardown of a killed process is no cause of
slow fault reports; tearing NCCL down in the survivors was (see ``distributed.shutdown``).
"""

import argparse
import json
import os
import signal
import time

PF_EXITING = 0x4


def child(conn, gib: float, shared, busy: bool) -> None:
    import torch

    block = torch.empty(int(gib * 2**30), dtype=torch.uint8, device="cuda")
    block.fill_(1)
    mapped = shared.clone() if shared is not None else None  # touches the mapped memory
    torch.cuda.synchronize()
    conn.send_bytes(b"ready")
    if busy:
        a = torch.randn(8192, 8192, device="cuda")
        while True:
            a = a @ a
            a = a / a.norm()
    conn.recv_bytes()  # idle: blocks until killed
    del mapped


def stat(pid: int):
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    fields = data[data.rindex(b")") + 2:].split()
    return fields[0].decode(), int(fields[6]), int(fields[49]) if len(fields) > 49 else 0


def case(gib: float, busy: bool, shared) -> dict:
    import torch.multiprocessing as tmp

    context = tmp.get_context("spawn")
    parent, child_end = context.Pipe()
    process = context.Process(target=child, args=(child_end, gib, shared, busy), daemon=True)
    process.start()
    child_end.close()
    if not parent.poll(120):
        raise RuntimeError("child did not start")
    parent.recv_bytes()
    time.sleep(0.5 if not busy else 1.0)
    seen: dict[str, float] = {}
    t0 = time.monotonic()
    os.kill(process.pid, signal.SIGKILL)
    while time.monotonic() - t0 < 60:
        t = round(time.monotonic() - t0, 4)
        s = stat(process.pid)
        if s is not None:
            state, flags, code = s
            if flags & PF_EXITING:
                seen.setdefault("exiting", t)
            if code:
                seen.setdefault("exit_code", t)
                seen.setdefault("exit_code_value", code)
            if state in ("Z", "X"):
                seen.setdefault("zombie", t)
            seen.setdefault("first_state", state)
        if "pipe_eof" not in seen and parent.poll(0):
            try:
                parent.recv_bytes()
            except (EOFError, OSError):
                seen["pipe_eof"] = t
        if not process.is_alive():
            seen["reaped"] = round(time.monotonic() - t0, 4)
            break
        time.sleep(0.002)
    return {"gib": gib, "busy": busy, "ipc": shared is not None, **seen}


def main() -> None:
    import torch

    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, nargs="+", default=[1.0, 20.0])
    args = parser.parse_args()
    shared = torch.ones(64 * 2**20, dtype=torch.uint8, device="cuda")  # 64 MiB, mapped by children
    for gib in args.gib:
        for busy in (False, True):
            print(json.dumps(case(gib, busy, shared)), flush=True)
    print(json.dumps(case(1.0, False, None)), flush=True)


if __name__ == "__main__":
    main()
