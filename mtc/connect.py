"""How a :class:`~mtc.CheckpointManager` reaches its hosts: the dispatcher its mode
names, the network tier of a multi-controller process, the watch over its
hosts' replicators, and how it names where its steps are.

Functions of the manager's options and topology, so that the manager itself
only composes what they return.
"""

from __future__ import annotations

import logging
from pathlib import Path

import jax

from mtc.contract import AgentConfig
from mtc.dispatch import (
    ColocatedDispatch,
    Dispatch,
    LocalDispatch,
    NetworkTier,
    Opened,
    ProcessDispatch,
)
from mtc.dispatch.process import find_sidecars
from mtc.errors import ConfigError
from mtc.options import Options
from mtc.replicas import credentials
from mtc.replicator_watch import ReplicatorWatch
from mtc.save.device_copy import DeviceCopier
from mtc.topology import Topology

# The manager's log lines keep one logger name, the one users configure.
log = logging.getLogger("mtc.manager")


def dispatch(mode: str, config: AgentConfig, options: Options, devices: list[jax.Device],
             topology: Topology) -> tuple[str, Dispatch]:
    """The dispatcher of ``mode``, and the mode. The sidecars take the replicators'
    credentials (a token, or this process's certificate). ``"auto"`` with
    sidecars: the colocated dispatch where every sidecar runs colocated Python,
    as Pathways workers do, else the process dispatch. The local dispatcher of a
    multi-controller process with replicators reaches other hosts' files over
    them (:func:`network_tier`; :meth:`Dispatch.networked`)."""
    sidecars = (find_sidecars(config, options.sidecars, creds=credentials(options))
                if options.sidecars and mode in ("auto", "process", "colocated") else None)
    if mode == "auto":
        mode = ("colocated" if sidecars and all(s.colocated for s in sidecars.values())
                else "process")
    if mode == "process":
        return mode, ProcessDispatch(config, sidecars or {}, creds=credentials(options))
    copier = DeviceCopier(options.save_device_copy_bytes)
    if mode == "colocated":
        return mode, ColocatedDispatch(config, devices, sidecars, copier=copier)
    return mode, LocalDispatch(config, network_tier(options, topology), copier=copier)


def read_pod_names(options: Options) -> None:
    """With ``replicator_pod_names``: from now on this process reads a certificate
    naming one of the job's worker pods as that pod's rank, as the replicators do
    (process-wide; ``ConfigError`` when told another scheme before). Its own
    certificate must then name a rank or the controller's role: else it could
    prove no copy it reads (``ConfigError`` now, not copies read unproven later)."""
    names = options.replicator_pod_names
    if names is None:
        return
    from mtc.credentials import names_read_here
    from mtc.rank_names import PodNames, use_pod_names

    use_pod_names(PodNames(*names))
    creds = credentials(options)
    if not names_read_here(creds):
        raise ConfigError(
            f"certificate {creds.tls_cert} names no worker pod of replicator_pod_names "
            f"{names!r} (<prefix><slice>-<host>-xxxxx), no mtc-rank-<r> and not the "
            "controller's role: give this process its pod's own certificate, or the prefix "
            "its replicators take (--tls-pod-prefix)")


def network_tier(options: Options, topology: Topology) -> NetworkTier | None:
    """Multi-controller JAX with a RAM disk per process (no host subfolders): other
    hosts' files are reachable only through the replicators, when there are some."""
    if topology.subdirs or not options.replicators or options.simulated_hosts is not None:
        return None
    host = topology.local_hosts[0]
    ranks = options.replicator_ranks
    return NetworkTier(tuple(options.replicators), credentials(options), topology.local_hosts,
                       ranks[host] if ranks and host < len(ranks) else host, tuple(ranks or ()))


def watches_replicators(options: Options, topology: Topology) -> bool:
    """Whether a manager watches its hosts' replicators: a writer with as many
    replicators (and ranks) as hosts; else the first restore says what does not
    match."""
    addrs = tuple(options.replicators or ())
    ranks = tuple(options.replicator_ranks or range(len(addrs)))
    return not options.read_only and bool(addrs) and \
        len(addrs) == topology.num_hosts and len(ranks) == len(addrs)


def watch_replicators(options: Options, topology: Topology, config: AgentConfig,
                      opened: dict[int, Opened]) -> ReplicatorWatch | None:
    """With replicators, a writer checks that each of its hosts' replicators is the
    rank the job states and serves that host's RAM disk (``ConfigError``: the
    identity the open read there), and watches them at every save
    (:mod:`mtc.replicator_watch`)."""
    if not watches_replicators(options, topology):
        return None
    addrs = tuple(options.replicators or ())
    ranks = tuple(options.replicator_ranks or range(len(addrs)))
    hosts = topology.local_hosts
    watch = ReplicatorWatch({h: addrs[h] for h in hosts}, {h: ranks[h] for h in hosts},
                            credentials(options))
    try:
        watch.start({h: str(config.root(h)) for h in hosts},
                    {h: opened[h].identity for h in hosts}, subdirs=topology.subdirs)
    except BaseException:
        watch.close()
        raise
    return watch


def note_foreign(opened: dict[int, Opened], roots: str) -> dict[int, list[int]]:
    """Step folders on a manager's hosts that are not mtc's (no manifest: an Orbax
    checkpoint in the same folder): logged, and never listed, restored, replaced
    or deleted (:func:`mtc.layout.is_mtc_step`)."""
    found = {h: list(o.foreign) for h, o in opened.items() if o.foreign}
    if found:
        log.warning("mtc: step folders that are not mtc's (no mtc manifest: Orbax's or "
                    "another tool's) in %s: %s; mtc leaves them alone (never listed, "
                    "restored, replaced or deleted)", roots,
                    "; ".join(f"host {h}: {steps}" for h, steps in sorted(found.items())))
    return found


def where(options: Options, topology: Topology, local_dir: Path) -> str:
    """Where a manager's steps are, as the user configured it: the sidecars, or the
    RAM disk folder (never a folder of the controller's own)."""
    if options.sidecars:
        return f"the RAM disks behind sidecars {', '.join(options.sidecars)}"
    hosts = topology.local_hosts
    if len(hosts) > 1 and not topology.subdirs:
        return f"the RAM disk {local_dir} of each of {len(hosts)} hosts"
    return str(local_dir)


def roots_here(options: Options, topology: Topology, config: AgentConfig,
               where_: str) -> str:
    """Where the hosts this process serves keep their steps, as this process names
    them (a sidecar's or a worker's RAM disk is named, never opened, here)."""
    hosts = topology.local_hosts
    if options.sidecars:
        return where_
    if len(hosts) == 1:
        return str(config.root(hosts[0]))
    if topology.subdirs:
        return f"{config.local_dir}/host-{{{hosts[0]}..{hosts[-1]}}}"
    return f"the RAM disk ({config.local_dir}) of each of {len(hosts)} hosts"
