"""Which replicator rank a certificate's DNS name is: the one place that maps names to ranks.

Shared by the replicators, the host sidecars and the controller (``mtc certs``,
``mtc.connect``), which read and write the same names in certificates; the
controller's own role name is here too (:data:`CONTROLLER_NAME`).

Two kinds of name are a rank:

- ``mtc-rank-<r>`` (:func:`rank_name`), in certificates made by hand;
- a JobSet worker pod's own name, in the certificates cert-manager's CSI driver
  issues each pod (``${POD_NAME}``), once this process was told how the job names
  its pods (:func:`use_pod_names`, from the command line at start). Kubernetes
  names the pods of an Indexed Job ``<job>-<completion index>-<5 random
  characters>``, and JobSet names its Jobs ``<jobset>-<replicated job>-<job
  index>``: pod ``<jobset>-<replicated job>-<s>-<h>-xxxxx`` is host ``h`` of slice
  ``s``, rank ``s * hosts_per_slice + h``.

A name is read whole and strictly (no leading zeros, bounded digits, ``h`` below
the hosts per slice), so that no name is two ranks and no rank has a second
spelling. Nothing a peer sends changes how names map: the scheme is this
process's, set once.

A replicator reaching peer ``r`` must accept only a server whose certificate is
rank ``r``'s. gRPC checks a server's certificate against one name given in
advance (``grpc.ssl_target_name_override``), and a pod's name ends in characters
nobody can predict, so :class:`PeerServerName` learns the name from the peer's
certificate with a TLS handshake of its own, keeps it only when it is rank ``r``,
and hands it to gRPC, whose handshake then accepts only a certificate of the CA
bearing that name: whatever the first handshake met, the server is rank ``r``.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import socket
import ssl
import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from mtc.errors import ConfigError

if TYPE_CHECKING:
    from mtc.credentials import Credentials

log = logging.getLogger(__name__)

RANK_PREFIX = "mtc-rank-"
# The DNS name that makes a certificate the controller's: a role the certificate
# names, as a host's names its rank (docs/deploy.md says how it is issued).
CONTROLLER_NAME = "mtc-controller"
_RANK_DIGITS = re.compile(r"0|[1-9][0-9]{0,8}", re.ASCII)
# After the prefix: <job index>-<completion index>-<generated suffix>. Kubernetes
# generates 5 characters of [bcdfghjklmnpqrstvwxz2456789]; any 5 of [a-z0-9] are read.
_POD_TAIL = re.compile(r"(0|[1-9][0-9]{0,5})-(0|[1-9][0-9]{0,5})-[a-z0-9]{5}", re.ASCII)
_POD_PREFIX = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?-", re.ASCII)
MAX_GENERATED_PREFIX = 58  # Kubernetes cuts a generated name's prefix beyond this
MAX_NAME = 63              # a pod name used as a DNS name: one label
PROBE_TIMEOUT_S = 2.0
PROBE_EVERY_S = 1.0        # a peer's certificate is looked at at most this often


@dataclasses.dataclass(frozen=True)
class PodNames:
    """How a JobSet names its worker pods: ``<prefix><s>-<h>-xxxxx`` is host ``h`` of
    slice ``s``. ``prefix`` is ``<jobset>-<replicated job>-``."""

    prefix: str
    hosts_per_slice: int

    def __post_init__(self) -> None:
        if not _POD_PREFIX.fullmatch(self.prefix) or len(self.prefix) > MAX_GENERATED_PREFIX - 4:
            raise ConfigError(f"pod name prefix {self.prefix!r} is not <jobset>-<replicated "
                              f"job>- (lower-case letters, digits and '-', ending in '-', at "
                              f"most {MAX_GENERATED_PREFIX - 4} characters)")
        if not 1 <= self.hosts_per_slice <= 999_999:
            raise ConfigError(f"hosts per slice {self.hosts_per_slice} is not in 1..999999")

    def rank(self, name: str) -> int | None:
        """The rank pod ``name`` is, or None when it is not one of these pods' names."""
        if len(name) > MAX_NAME or not name.startswith(self.prefix):
            return None
        m = _POD_TAIL.fullmatch(name, len(self.prefix))
        if m is None:
            return None
        slice_index, host = int(m.group(1)), int(m.group(2))
        if host >= self.hosts_per_slice:  # else slice s, host h+H would be slice s+1's
            return None
        return slice_index * self.hosts_per_slice + host


_pods: PodNames | None = None
_pods_lock = threading.Lock()


def use_pod_names(pods: PodNames) -> None:
    """From now on this process reads a name of ``pods`` as that pod's rank. Called
    once at start, from the command line; telling it another scheme later is refused
    (a mapping that changed under running calls would make one name two ranks)."""
    global _pods
    with _pods_lock:
        if _pods is not None and _pods != pods:
            raise ConfigError(f"pod names are already read as {_pods}, not {pods}")
        _pods = pods


def pod_names() -> PodNames | None:
    """The scheme :func:`use_pod_names` set in this process (None: only ``mtc-rank-<r>``)."""
    return _pods


def rank_name(rank: int) -> str:
    """The DNS subject alternative name that makes a certificate rank ``rank``'s."""
    return f"{RANK_PREFIX}{rank}"


def rank_of(name: str | bytes, pods: PodNames | None = None) -> int | None:
    """The rank one DNS name is (``mtc-rank-<r>``, or a pod of ``pods``, by default the
    scheme of :func:`use_pod_names`), or None."""
    text = name.decode("ascii", errors="replace") if isinstance(name, bytes) else name
    if text.startswith(RANK_PREFIX):
        digits = text[len(RANK_PREFIX):]
        return int(digits) if _RANK_DIGITS.fullmatch(digits) else None
    pods = pods if pods is not None else _pods
    return pods.rank(text) if pods is not None else None


def ranks_named(names: Iterable[str | bytes], pods: PodNames | None = None) -> set[int]:
    """The ranks a certificate's DNS names name (:func:`rank_of` each)."""
    return {r for n in names if (r := rank_of(n, pods)) is not None}


def name_for_rank(names: Iterable[str], rank: int, pods: PodNames | None = None
                  ) -> str | None:
    """The name of ``names`` that is ``rank``, when the names are that rank and no other
    (a certificate naming two ranks is nobody's); else None."""
    names = list(names)
    if ranks_named(names, pods) != {rank}:
        return None
    return next(n for n in names if rank_of(n, pods) == rank)


def _host_port(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ConfigError(f"address {address!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


def server_names(address: str, creds: Credentials, *, timeout_s: float = PROBE_TIMEOUT_S
                 ) -> list[str]:
    """The DNS names in the certificate the server at ``address`` presents, verified
    against this process's CA, with this process's certificate presented (the server
    requires one). One TLS handshake, no call: the connection is closed after it."""
    assert creds.tls_cert and creds.tls_key and creds.tls_ca
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False  # the name is what this learns; gRPC checks it afterwards
    ctx.load_verify_locations(cadata=creds.tls_ca.read_text())
    ctx.load_cert_chain(creds.tls_cert, creds.tls_key)
    ctx.set_alpn_protocols(["h2"])
    host, port = _host_port(address)
    # The connect, and the handshake as a whole (CPython keeps one deadline for it),
    # each take at most timeout_s: a peer trickling bytes cannot hold this thread.
    with socket.create_connection((host, port), timeout=timeout_s) as sock, \
            ctx.wrap_socket(sock) as tls:
        cert = tls.getpeercert() or {}
    sans = cert.get("subjectAltName", ())
    return [str(v) for k, v in sans if k == "DNS"] if isinstance(sans, tuple) else []


class PeerServerName:
    """The name a replicator checks peer ``rank``'s server certificate against (gRPC's
    ``ssl_target_name_override``). Without pod names (:func:`use_pod_names`) it is
    ``mtc-rank-<rank>``. With them, it is the name of the peer's certificate that is
    rank ``rank``, learnt by a handshake of its own (:func:`server_names`) before the
    first call and again after a call found the peer unavailable (:meth:`stale`: a
    replaced pod has a new name); until then, ``mtc-rank-<rank>``. Thread-safe."""

    def __init__(self, address: str, creds: Credentials, rank: int) -> None:
        self._address = address
        self._creds = creds
        self._rank = rank
        self._lock = threading.Lock()
        self._learns = pod_names() is not None
        self._known = not self._learns
        self._next = 0.0
        self.name = rank_name(rank)

    def stale(self) -> None:
        """A call found the peer unavailable: look at its certificate again."""
        if self._learns:
            self._known = False

    def renewed(self) -> bool:
        """Whether :attr:`name` just changed (a channel made with the old one is
        stale). Looks at the peer's certificate when its name is not known, at most
        every :data:`PROBE_EVERY_S`; a peer that cannot be reached, or whose
        certificate is not rank ``rank``'s, leaves the name as it was."""
        # Another thread looking already: calls go on with the current name meanwhile.
        if self._known or not self._lock.acquire(blocking=False):
            return False
        try:
            now = time.monotonic()
            if self._known or now < self._next:
                return False
            self._next = now + PROBE_EVERY_S
            try:
                names = server_names(self._address, self._creds)
            except (OSError, ValueError, ConfigError) as e:  # ssl.SSLError is an OSError
                log.debug("rank %d at %s: no certificate read: %s", self._rank,
                          self._address, e)
                return False
            name = name_for_rank(names, self._rank)
            if name is None:
                log.warning("the server at %s, asked as rank %d, presents a certificate "
                            "naming %s: refused", self._address, self._rank,
                            sorted(ranks_named(names)) or "no rank")
                return False
            self._known = True
            changed, self.name = name != self.name, name
            return changed
        finally:
            self._lock.release()


# A certificate of the CA that names neither a rank nor the controller's role
# (:data:`CONTROLLER_NAME`) is nobody's.
CONTROLLER = "controller"
# Who a certificate is: a rank, CONTROLLER, or None (nobody).
Who = int | str | None


def identity_of(names: Iterable[str | bytes]) -> Who:
    """Who a certificate with these DNS names is: the one rank it names, the
    controller (it names ``CONTROLLER_NAME`` and no rank), or None: it names
    neither, several ranks, or a rank and the controller (one certificate is one
    identity)."""
    texts = [n.decode("ascii", errors="replace") if isinstance(n, bytes) else n
             for n in names]
    ranks = ranks_named(texts)
    controller = CONTROLLER_NAME in texts
    if controller and not ranks:
        return CONTROLLER
    if len(ranks) == 1 and not controller:
        return next(iter(ranks))
    return None


def describe(who: Who) -> str:
    return (f"rank {who}" if isinstance(who, int) else "the controller" if who else
            "no rank and not the controller")
