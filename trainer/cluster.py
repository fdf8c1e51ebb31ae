"""``mtc-cluster``: a local cluster of simulated hosts that share nothing, one command up, one down.

    python -m mtc.trainer.cluster up   [--name N] [--slices 2] [--hosts-per-slice 2]
                                   [--backup URL | --backup gcs-emulator]
    python -m mtc.trainer.cluster status [--name N]
    python -m mtc.trainer.cluster down [--name N]

The cluster itself is :class:`mtc.testing.local_cluster.LocalCluster` (every host its
own sidecar and replicator, a RAM disk of its own): ``up`` writes the hosts
(addresses, process ids, namespaces) to ``<base>/cluster.json``; ``down`` reads
that file, SIGKILLs every host's processes (the way a host dies), removes the
namespaces, stops the emulator and removes the folder. ``status`` is ``mtc status``
against every host's replicator.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mtc.testing.local_cluster import GCS_EMULATOR, STATE, LocalCluster, default_base


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="mtc-cluster", description=__doc__.splitlines()[0])
    p.add_argument("command", choices=("up", "down", "status"))
    p.add_argument("--name", default="local")
    p.add_argument("--base", type=Path, help="default: /dev/shm/mtc-cluster-<name>")
    p.add_argument("--slices", type=int, default=2)
    p.add_argument("--hosts-per-slice", type=int, default=2)
    p.add_argument("--backup", help="backup URL (default: file://<base>/backup), or "
                   f"{GCS_EMULATOR!r}: start fake-gcs-server and back up to a bucket there")
    p.add_argument("--colocated-devices", type=int, default=0,
                   help="the trainer's CPU devices: the sidecars also run colocated Python "
                        "on their share of them (0: they do not)")
    args = p.parse_args(argv)
    base = args.base or default_base(args.name)
    if args.command == "up":
        c = LocalCluster.up(base, slices=args.slices, hosts_per_slice=args.hosts_per_slice,
                            backup=args.backup, colocated_devices=args.colocated_devices)
        print(f"cluster {base}: {c.num_hosts} hosts in {c.slices} slices, replicators "
              f"{','.join(c.addresses)}, backup {c.backup}")
        print(f"  hosts kept apart by {c.isolation}; status: python -m mtc.cli status "
              f"--token-file {c.token_file()} --nodes {','.join(c.addresses)}")
        return 0
    if not (base / STATE).exists():
        print(f"no cluster in {base}", file=sys.stderr)
        return 0 if args.command == "down" else 1
    c = LocalCluster.load(base)
    if args.command == "down":
        c.down()
        print(f"cluster {base}: hosts stopped, RAM disks removed")
        return 0
    from mtc.cli import status
    from mtc.credentials import Credentials

    return status(c.addresses, Credentials(token=c.token()), False)


if __name__ == "__main__":
    sys.exit(main())
