"""How the controller reaches host-side code: the host seam.

Every host operation goes through a dispatcher: stage and write a save, wait for
it, load a restore's shards, and the small operations of :class:`HostCalls`
(list committed steps, read a manifest, read a region, delete, retain, clean).
The controller never opens, lists or deletes anything under a RAM disk itself.
Three dispatchers drive the same host-side code (``sidecar/``): in this process
(multi-controller JAX, where each process is its own host), through colocated
Python (Pathways), or in a sidecar process per host over gRPC (the local
cluster); they differ only in how requests and bytes travel. Each operation is
defined once (:mod:`mtc.operations`) and made a typed call once (:class:`HostCalls`);
a dispatcher adds its transport: how a request reaches the hosts (``_call``)
and how a save's and a restore's arrays move.
"""

from mtc.dispatch.calls import Dispatch, HostCalls
from mtc.dispatch.colocated import ColocatedDispatch
from mtc.dispatch.local import LocalDispatch, NetworkTier
from mtc.dispatch.process import ProcessDispatch, Sidecar
from mtc.dispatch.protocol import Opened, WorkerLostError

__all__ = ["ColocatedDispatch", "Dispatch", "HostCalls", "LocalDispatch", "NetworkTier",
           "Opened", "ProcessDispatch", "Sidecar", "WorkerLostError"]
