"""Whose bytes a copy is: a peer copy's proof that its origin rank made it (issue 57).

With mutual TLS a peer authenticates as one rank, and a copy of rank X's step is
only offered by rank X (``Offer`` checks the caller). But an inventory also lists
what a host holds of *other* ranks, and a restore checks the bytes it fetches
against the checksums that same holder lists: a host with its own valid
certificate could list a "copy" of rank 0's step made of its own bytes, and rank
0 would restore them. CRC32C cannot help (a forger picks bytes with any CRC it
likes); a signature over cryptographic digests can.

So the origin signs a statement of each own step it offers (:func:`sign`), with
the private key of the TLS certificate that names its rank: ``mtc-copy/v1``, its
rank, the step, the run, the saving hosts, the file list's fingerprint, and the
SHA-256 of the file list in which every file carries its SHA-256
(:func:`files_digest`). The proof (:class:`~pb.CopyProof`: that digest, the
signature, the signer's certificate chain) travels in the ``Offer``; the holder
checks it, keeps it beside the copy and lists it with the copy. Whoever reads
another host's copy of rank X's data (the agreement, a restore, the trainer's
peer reads) takes it only when :func:`why_unproven` finds nothing wrong: the
chain ends at the cluster's CA and names rank X and nothing else, the
signature is good, the entry states what was signed and, with files, its files
are the ones signed. A restore then checks the SHA-256 of every fetched file
against the proven list before it places the step.

Without TLS there are no keys, and nothing is proven: a token names nobody, and
its holder can act as any rank anyway (docs/security.md). Copies then count as
before, checked by CRC32C against damage, not forgery.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, padding, rsa
from cryptography.x509.verification import (
    Criticality,
    ExtensionPolicy,
    PolicyBuilder,
    Store,
    VerificationError,
)

from mtc.credentials import Credentials
from mtc.errors import ConfigError
from mtc.proto import replicator_pb2 as pb
from mtc.rank_names import describe, identity_of
from mtc.sidecar.replicator.store.step_files import FileMeta, fingerprint_of, inside
from mtc.sidecar.storage.checksum import file_sha256

log = logging.getLogger(__name__)

STATEMENT = "mtc-copy/v1"
MAX_CHAIN = 4               # certificates in a proof's chain
MAX_CERT_BYTES = 16 << 10   # each
MAX_SIGNATURE_BYTES = 1024  # RSA-4096's is 512
VERIFIED_CACHE = 4096       # proofs remembered as checked (an inventory lists the same ones)
VERIFIED_TTL_S = 60.0       # a certificate expired or a CA rotated counts within this
CHAINS_CACHE = 256          # certificate chains remembered as checked (one per rank, in use)
# Proofs not remembered that one inventory may have checked at once: a holder lists a
# few copies per origin (its replicas' kept steps), each checked once a minute; a
# member listing thousands of made-up ones costs a signature check each (issue 66),
# so beyond this the rest wait for a later gather, unchecked and not counted.
NEW_CHECKS_PER_INVENTORY = 64


@dataclasses.dataclass(frozen=True)
class Statement:
    """What an origin signs of one copy of its data."""

    origin: int
    step: int
    run: str
    saved_hosts: int
    saving_ranks: tuple[int, ...]
    fingerprint: int
    digest: bytes

    def to_bytes(self) -> bytes:
        return json.dumps([STATEMENT, self.origin, self.step, self.run, self.saved_hosts,
                           list(self.saving_ranks), self.fingerprint, self.digest.hex()],
                          separators=(",", ":")).encode()


def files_digest(files: Iterable[tuple[str, int, int, bytes]]) -> bytes:
    """SHA-256 of a file list: (path, size, CRC32C, SHA-256) of each, by path."""
    rows = sorted([p, int(s), int(c), bytes(h).hex()] for p, s, c, h in files)
    return hashlib.sha256(json.dumps(rows, separators=(",", ":")).encode()).digest()


def statement_of(c: pb.StepCopy) -> Statement:
    """The statement an entry (an offer's, an inventory's) claims its proof signs."""
    return Statement(c.origin_rank, c.step, c.run, c.saved_hosts, tuple(c.saving_ranks),
                     c.fingerprint, bytes(c.proof.digest))


def sign(c: pb.StepCopy, sha256: dict[str, bytes], key: object, chain: Sequence[bytes]
         ) -> None:
    """Fill ``c`` (an own step's entry: step, origin, run, hosts, files) with each
    file's SHA-256, its fingerprint and its proof, signed with ``key`` (the private
    key of the certificate chain ``chain``, DER, leaf first)."""
    for f in c.files:
        f.sha256 = sha256[f.path]
    c.fingerprint = fingerprint_of([FileMeta(f.path, f.size, f.crc32c) for f in c.files])
    c.proof.digest = files_digest((f.path, f.size, f.crc32c, f.sha256) for f in c.files)
    data = statement_of(c).to_bytes()
    if isinstance(key, ec.EllipticCurvePrivateKey):
        signature = key.sign(data, ec.ECDSA(hashes.SHA256()))
    elif isinstance(key, rsa.RSAPrivateKey):
        signature = key.sign(data, padding.PKCS1v15(), hashes.SHA256())
    elif isinstance(key, ed25519.Ed25519PrivateKey):
        signature = key.sign(data)
    else:
        raise ConfigError(f"a {type(key).__name__} key cannot sign copies (ECDSA, RSA or "
                          "Ed25519)")
    c.proof.signature = signature
    c.proof.chain[:] = list(chain)


def _signed(public: object, signature: bytes, data: bytes) -> bool:
    try:
        if isinstance(public, ec.EllipticCurvePublicKey):
            public.verify(signature, data, ec.ECDSA(hashes.SHA256()))
        elif isinstance(public, rsa.RSAPublicKey):
            public.verify(signature, data, padding.PKCS1v15(), hashes.SHA256())
        elif isinstance(public, ed25519.Ed25519PublicKey):
            public.verify(signature, data)
        else:
            return False
    except InvalidSignature:
        return False
    return True


def _dns_names(cert: x509.Certificate) -> list[str]:
    try:
        return list(cert.extensions.get_extension_for_class(
            x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName))
    except x509.ExtensionNotFound:
        return []


def _is_ca(policy: object, cert: x509.Certificate, bc: x509.BasicConstraints) -> None:
    if not bc.ca:
        raise ValueError("an issuer that is no CA")


# The extensions a chain needs are those TLS (OpenSSL, which gRPC uses) needs:
# issuers that are CAs; the web's further rules (key identifiers, a CA's key
# usage) are not asked: mtc certs and cert-manager write no key identifiers, and a
# CA with basic constraints alone is one TLS accepts. Signatures, validity and
# the chain's end at the cluster's CA are checked whatever the policy.
_CA_POLICY = ExtensionPolicy.permit_all().require_present(
    x509.BasicConstraints, Criticality.AGNOSTIC, _is_ca)
_LEAF_POLICY = ExtensionPolicy.permit_all()


def why_chain_not(chain: Sequence[bytes], origin: int, cas: Sequence[x509.Certificate],
                  now: datetime.datetime) -> tuple[str | None, object]:
    """Why ``chain`` (DER, leaf first) is not rank ``origin``'s certificate under
    ``cas`` at ``now``; None and the leaf's public key when it is."""
    if not chain or len(chain) > MAX_CHAIN or any(len(c) > MAX_CERT_BYTES for c in chain):
        return f"a chain of {len(chain)} certificates (1 to {MAX_CHAIN})", None
    try:
        certs = [x509.load_der_x509_certificate(bytes(c)) for c in chain]
        verifier = (PolicyBuilder().store(Store(list(cas))).time(now)
                    .extension_policies(ca_policy=_CA_POLICY, ee_policy=_LEAF_POLICY)
                    .build_client_verifier())
        verifier.verify(certs[0], certs[1:])
    except (ValueError, VerificationError) as e:
        return f"its certificate does not chain to the cluster's CA ({e})", None
    who = identity_of(_dns_names(certs[0]))
    if who != origin:
        return f"its certificate names {describe(who)}, not rank {origin}", None
    return None, certs[0].public_key()


def why_unproven(c: pb.StepCopy, cas: Sequence[x509.Certificate],
                 now: datetime.datetime) -> str | None:
    """Why entry ``c`` is not proven rank ``c.origin_rank``'s (None: it is): see the
    module's doc. With files, every file's SHA-256 must be there and the list be
    the one signed."""
    p = c.proof
    if not p.signature or not p.chain:
        return "it carries no proof"
    if len(p.signature) > MAX_SIGNATURE_BYTES or len(p.digest) != 32:
        return "its proof is malformed"
    why, public = why_chain_not(p.chain, c.origin_rank, cas, now)
    if why is not None:
        return why
    return why_signature_not(c, public)


def why_signature_not(c: pb.StepCopy, public: object) -> str | None:
    """Why ``c``'s signature, by the holder of ``public`` (its chain checked), is not
    of what ``c`` states, or its files not the ones signed (None: they are)."""
    if not _signed(public, bytes(c.proof.signature), statement_of(c).to_bytes()):
        return "its signature does not match what it states"
    return why_files_not(c)


def why_files_not(c: pb.StepCopy) -> str | None:
    """Why ``c``'s files (when listed) are not the signed list (None: they are)."""
    if not c.files:
        return None
    if any(len(f.sha256) != 32 for f in c.files):
        return "a file carries no SHA-256"
    if files_digest((f.path, f.size, f.crc32c, f.sha256) for f in c.files) != c.proof.digest:
        return "its files are not the ones signed"
    if fingerprint_of([FileMeta(f.path, f.size, f.crc32c) for f in c.files]) != c.fingerprint:
        return "its fingerprint is not its files'"
    return None


def not_signed(folder: Path, c: pb.StepCopy,
               map_: Callable[[Callable[[str], bytes], list[str]], Iterable[bytes]] = map
               ) -> str | None:
    """The first file of proven entry ``c`` whose bytes in ``folder`` are not the
    ones its origin signed (their SHA-256: CRC32C, checked on arrival, finds damage,
    not bytes a holder made up to match it); None when every one is, or when ``c``
    carries no SHA-256s (no mutual TLS, or its origin's own listing). ``map_``:
    hashes on a pool's threads."""
    want = [(f.path, bytes(f.sha256)) for f in c.files if f.sha256]
    got = map_(lambda p: file_sha256(inside(folder, p)), [p for p, _ in want])
    return next((p for (p, sha), d in zip(want, got, strict=True) if d != sha), None)


def own_signed(rank: int, step: int, files: Sequence[FileMeta],
               invs: Mapping[int, pb.Inventory], run: str = "",
               proven: Callable[[pb.StepCopy], bool] = lambda c: True
               ) -> dict[str, bytes] | None:
    """The SHA-256 rank ``rank`` signed for each of ``files`` (its own ``step``, of
    ``run`` when given), from a copy of its data another host lists with its proof
    (``proven`` says the proof holds; the gathering checked it already): what a
    healed own file must hash to, whichever host's bytes it came from (CRC32C finds
    damage, not bytes made to match it). Only a copy of exactly these files (path,
    size, CRC32C) counts; None when no host lists one. Pure."""
    want = sorted((f.path, f.size, f.crc32c) for f in files)
    if not want:
        return None
    for holder, inv in sorted(invs.items()):
        for c in inv.copies if holder != rank else ():
            if c.step != step or c.origin_rank != rank or (run and c.run != run) or \
                    not c.proof.signature or any(len(f.sha256) != 32 for f in c.files) or \
                    sorted((f.path, f.size, f.crc32c) for f in c.files) != want:
                continue
            if proven(c):
                return {f.path: bytes(f.sha256) for f in c.files}
    return None


class ProofCheck:
    """Proofs checked against the cluster's CA (``--tls-ca``, read again when the
    file changes), a checked one remembered for :data:`VERIFIED_TTL_S`. Thread-safe."""

    def __init__(self, creds: Credentials) -> None:
        assert creds.tls_ca is not None
        self._creds = creds
        self._lock = threading.Lock()
        self._stamp: tuple[int, int] | None = None
        self._cas: list[x509.Certificate] = []
        self._seen: OrderedDict[bytes, tuple[float, str | None]] = OrderedDict()
        # (origin, the chain's bytes) -> (when, why not, its leaf's public key): a
        # chain's path to the CA is the costly part of a check (about 2 ms), and
        # every proof of one rank carries the same chain.
        self._chains: OrderedDict[bytes, tuple[float, str | None, object]] = OrderedDict()

    @classmethod
    def of(cls, creds: Credentials | None) -> ProofCheck | None:
        """The check under mutual TLS; None without it (nothing can be proven)."""
        return cls(creds) if creds is not None and creds.tls else None

    def _ca(self) -> list[x509.Certificate]:
        assert self._creds.tls_ca is not None
        st = self._creds.tls_ca.stat()
        stamp = (st.st_ino, st.st_mtime_ns)
        with self._lock:
            if stamp == self._stamp:
                return self._cas
        cas = x509.load_pem_x509_certificates(self._creds.tls_ca.read_bytes())
        with self._lock:
            self._stamp, self._cas = stamp, cas
            self._seen.clear()
            self._chains.clear()
        return cas

    def why_not(self, c: pb.StepCopy, *, fresh: list[int] | None = None) -> str | None:
        """:func:`why_unproven` of ``c`` now. ``fresh``: a budget of checks not
        remembered (its one element, decremented by each): with none left, ``c`` is
        not checked and counts as unproven (without being remembered so)."""
        # Cheap things first: a proof's shape, before anything is parsed or hashed.
        p = c.proof
        if not p.signature or not p.chain:
            return "it carries no proof"
        if len(p.signature) > MAX_SIGNATURE_BYTES or len(p.digest) != 32 or \
                not 0 < len(p.chain) <= MAX_CHAIN or any(len(x) > MAX_CERT_BYTES
                                                        for x in p.chain):
            return "its proof is malformed"
        try:
            cas = self._ca()
        except (OSError, ValueError) as e:
            return f"the cluster's CA cannot be read ({e})"
        # The signature's part (without the files, checked each time below).
        head = pb.StepCopy(step=c.step, origin_rank=c.origin_rank, saved_hosts=c.saved_hosts,
                           run=c.run, fingerprint=c.fingerprint, saving_ranks=c.saving_ranks,
                           proof=c.proof)
        key = hashlib.sha256(head.SerializeToString(deterministic=True)).digest()
        now = datetime.datetime.now(datetime.UTC)
        with self._lock:
            hit = self._seen.get(key)
        if hit is not None and now.timestamp() - hit[0] < VERIFIED_TTL_S:
            why = hit[1]
        elif fresh is not None and fresh[0] <= 0:
            return "not checked: this inventory lists more new proofs than are checked at once"
        else:
            if fresh is not None:
                fresh[0] -= 1
            why, public = self._chain(c, cas, now)
            if why is None:
                why = why_signature_not(head, public)
            with self._lock:
                self._seen[key] = (now.timestamp(), why)
                while len(self._seen) > VERIFIED_CACHE:
                    self._seen.popitem(last=False)
        return why if why is not None else why_files_not(c)

    def _chain(self, c: pb.StepCopy, cas: Sequence[x509.Certificate], now: datetime.datetime
               ) -> tuple[str | None, object]:
        """:func:`why_chain_not` of ``c``'s chain for its origin, remembered a while."""
        h = hashlib.sha256(str(c.origin_rank).encode())
        for der in c.proof.chain:
            h.update(len(der).to_bytes(4, "big") + der)
        key = h.digest()
        with self._lock:
            hit = self._chains.get(key)
        if hit is not None and now.timestamp() - hit[0] < VERIFIED_TTL_S:
            return hit[1], hit[2]
        why, public = why_chain_not(c.proof.chain, c.origin_rank, cas, now)
        with self._lock:
            self._chains[key] = (now.timestamp(), why, public)
            while len(self._chains) > CHAINS_CACHE:
                self._chains.popitem(last=False)
        return why, public

    def drop_unproven(self, inv: pb.Inventory) -> list[str]:
        """Remove from a peer's inventory every copy of another rank's data that is
        not proven that rank's; returns why each went. At most
        :data:`NEW_CHECKS_PER_INVENTORY` proofs not remembered are checked."""
        keep, gone = [], []
        fresh = [NEW_CHECKS_PER_INVENTORY]
        for c in inv.copies:
            why = None if c.origin_rank == inv.rank else self.why_not(c, fresh=fresh)
            if why is None:
                keep.append(c)
            else:
                gone.append(f"rank {c.origin_rank}'s step {c.step}: {why}")
        if gone:
            del inv.copies[:]
            inv.copies.extend(keep)
        return gone


class Signer:
    """Signs this rank's copies with the key of its certificate (read again when
    the files change: a rotation signs with the new key from then on)."""

    def __init__(self, creds: Credentials) -> None:
        self._creds = creds
        self._lock = threading.Lock()
        self._stamp: object = None
        self._key: object = None
        self._chain: list[bytes] = []

    @classmethod
    def of(cls, creds: Credentials | None) -> Signer | None:
        return cls(creds) if creds is not None and creds.tls else None

    def _material(self) -> tuple[object, list[bytes]]:
        with self._lock:
            if self._key is not None and self._creds.tls_stamp() == self._stamp:
                return self._key, self._chain
            stamp, cert, key, _ = self._creds.read_tls()
            self._key = serialization.load_pem_private_key(key, password=None)
            self._chain = [c.public_bytes(serialization.Encoding.DER)
                           for c in x509.load_pem_x509_certificates(cert)]
            self._stamp = stamp
            return self._key, self._chain

    def sign(self, c: pb.StepCopy, sha256: dict[str, bytes]) -> None:
        """:func:`sign` with this rank's key."""
        key, chain = self._material()
        sign(c, sha256, key, chain)
