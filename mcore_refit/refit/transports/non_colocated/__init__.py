"""Non-colocated transport: every buffer goes from its source trainer rank to every inference rank.

A non-colocated job (:class:`~mcore_refit.non_colocated.NonColocatedJob`) has trainer ranks and
inference ranks. Every buffer of the plan has a source: the trainer rank whose export fills it.
From there it reaches each inference rank over one of two links (:class:`.placement.Placement`
says which):

- **broadcast**: over the source's own data group (the source and every inference rank on another
  device; NCCL on GPUs), from one of the source's slots into one of the receiver's. Sources have
  a group each, so buffers of different sources move at once;
- **IPC hand-over** (:mod:`.handover`): an inference rank on the source's own device maps the
  source's slots once (CUDA IPC, shared memory on CPU) and loads each buffer straight from them;
  NCCL refuses two ranks of one device in a communicator, and the copy stays on the device.

Both ends use ``plan.num_slots`` slots round-robin with a CUDA stream and events each: exporting
and packing buffer k+1 overlaps moving buffer k, and a receiver loads buffer k while k+1 arrives.
Receivers post a broadcast only once the refit has started (a host-side exchange) and only into a
free slot, so no rank holds a GPU kernel waiting for a peer between refits.

All waiting for peers is on the host, over the control plane (:mod:`mcore_refit.control`): the
start of a refit (:mod:`..rounds`: plan fingerprints, switches), every IPC buffer's ready and
ACK messages, and the final outcome exchange, which raises a failure on every rank, naming the
rank. A rank that failed keeps taking part in every exchange and transfer without loading, so
nobody waits alone. Works with NCCL (CUDA tensors) and gloo (CPU tensors; streams and events are
no-ops). The trainer end is :mod:`.sender`, the inference end :mod:`.receiver`.
"""
