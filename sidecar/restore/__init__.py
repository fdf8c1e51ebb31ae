"""A restore on one host, after the controller planned it (``mtc/restore/``): the
regions the plan names read from the host's files, each byte checked against the
manifest, and put on devices.

- :mod:`.load`: read tasks, a host's regions from the pieces that cover them;
- :mod:`.read`: shard files mapped or read back, every byte verified;
- :mod:`.peers`: pieces another host saved, fetched from the replicators over the
  network tier (multi-controller JAX), never through a filesystem;
- :mod:`.colocated_load`: a Pathways worker's side of a colocated restore, its
  regions as arrays on its own colocated CPU devices.

Run by the host side (the colocated-Python sidecar of a Pathways worker, each
process of multi-controller JAX, or the controller's own process for simulated
hosts). A replaced host's data is brought back onto its RAM disk before this by
the replicator (``sidecar/replicator/fetch/``).
"""
