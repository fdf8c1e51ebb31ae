"""A copy's proof that its origin made it (sidecar/replicator/copies/provenance.py): signed
with a rank's certificate key, checked against the cluster's CA, the rank the
certificate names, and what the entry states; pure, in this process."""

from __future__ import annotations

import datetime
import hashlib
from collections.abc import Callable
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from replicator_certs import make_ca, make_leaf

from mtc.credentials import Credentials, names_read_here
from mtc.proto import replicator_pb2 as pb
from mtc.sidecar.replicator.copies import provenance as pv
from mtc.sidecar.replicator.store.copy_proofs import HeldProofs, OwnProofs, proof_path, put_proof
from mtc.sidecar.replicator.store.step_files import FileMeta
from mtc.sidecar.storage.checksum import file_crc, file_sha256

# When the pure checks take place: an hour after this module is imported. The test
# certificates are made when the first test asks for them, valid from 5 minutes
# before that for a day; "now" at import was before them once collection and the
# first test were more than 5 minutes apart (a long session).
NOW = datetime.datetime.now(datetime.UTC) + datetime.timedelta(hours=1)
FILES = {"a.bin": b"alpha" * 100, "d/b.bin": b"beta" * 50}


def _der(path: Path) -> bytes:
    return x509.load_pem_x509_certificate(path.read_bytes()).public_bytes(
        serialization.Encoding.DER)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    d = tmp_path_factory.mktemp("pki")
    ca, other = make_ca("cluster CA"), make_ca("another CA")
    out: dict[str, object] = {"ca": ca[1], "dir": d}
    for name, issuer, kw in (("rank0", ca, {"ranks": [0]}), ("rank1", ca, {"ranks": [1]}),
                             ("both", ca, {"ranks": [0, 1]}),
                             ("controller", ca, {"controller": True}),
                             ("stranger0", other, {"ranks": [0]})):
        crt, key = make_leaf(issuer, name, d, **kw)  # type: ignore[arg-type]
        out[name] = (serialization.load_pem_private_key(key.read_bytes(), None), _der(crt))
        out[name + "_files"] = (crt, key)
    return out


def _entry(pki: dict[str, object], signer: str = "rank0", origin: int = 0) -> pb.StepCopy:
    c = pb.StepCopy(step=777, origin_rank=origin, run="run-a", saved_hosts=2,
                    saving_ranks=[0, 1],
                    files=[pb.FileInfo(path=p, size=len(b), crc32c=len(b) * 7)
                           for p, b in sorted(FILES.items())])
    key, der = pki[signer]  # type: ignore[misc]
    pv.sign(c, {p: hashlib.sha256(b).digest() for p, b in FILES.items()}, key, [der])
    return c


def _set(field: str, value: object) -> Callable[[pb.StepCopy], None]:
    return lambda c: setattr(c, field, value)


def _file(i: int, field: str, value: object) -> Callable[[pb.StepCopy], None]:
    return lambda c: setattr(c.files[i], field, value)


def _drop_files(c: pb.StepCopy) -> None:
    del c.files[1:]


def _no_proof(c: pb.StepCopy) -> None:
    c.ClearField("proof")


def _no_signature(c: pb.StepCopy) -> None:
    c.proof.signature = b""


# (what is changed after signing, who signed, the origin the entry names, why refused)
CASES: list[tuple[str, Callable[[pb.StepCopy], None] | None, str, int, str | None]] = [
    ("as signed", None, "rank0", 0, None),
    ("signed by the rank it names", None, "rank1", 1, None),
    ("wrong rank in the certificate", None, "rank1", 0, "names rank 1, not rank 0"),
    ("a certificate naming two ranks", None, "both", 0, "not rank 0"),
    ("the controller's certificate", None, "controller", 0, "names the controller"),
    ("another CA's certificate naming the rank", None, "stranger0", 0,
     "does not chain to the cluster's CA"),
    ("no proof", _no_proof, "rank0", 0, "no proof"),
    ("no signature", _no_signature, "rank0", 0, "no proof"),
    ("another step", _set("step", 778), "rank0", 0, "signature does not match"),
    ("another run", _set("run", "run-b"), "rank0", 0, "signature does not match"),
    ("another origin", _set("origin_rank", 1), "rank0", 0, "names rank 0, not rank 1"),
    ("other saving hosts", _set("saved_hosts", 1), "rank0", 0, "signature does not match"),
    ("another fingerprint", _set("fingerprint", 5), "rank0", 0, "signature does not match"),
    ("a file's CRC32C altered", _file(0, "crc32c", 1), "rank0", 0, "not the ones signed"),
    ("a file's size altered", _file(0, "size", 3), "rank0", 0, "not the ones signed"),
    ("a file's SHA-256 altered", _file(1, "sha256", b"\0" * 32), "rank0", 0,
     "not the ones signed"),
    ("a file's SHA-256 missing", _file(1, "sha256", b""), "rank0", 0, "no SHA-256"),
    ("a file renamed", _file(0, "path", "c.bin"), "rank0", 0, "not the ones signed"),
    ("a file left out", _drop_files, "rank0", 0, "not the ones signed"),
]


@pytest.mark.parametrize(("name", "change", "signer", "origin", "why"), CASES,
                         ids=[c[0] for c in CASES])
def test_a_proof_holds_only_for_what_its_origin_signed(
        pki: dict[str, object], name: str, change: Callable[[pb.StepCopy], None] | None,
        signer: str, origin: int, why: str | None) -> None:
    c = _entry(pki, signer, origin)
    if change is not None:
        change(c)
    got = pv.why_unproven(c, [pki["ca"]], NOW)  # type: ignore[list-item]
    if why is None:
        assert got is None
    else:
        assert got is not None and why in got, got


def test_an_entry_without_its_files_is_checked_by_its_signature_alone(
        pki: dict[str, object]) -> None:
    """An inventory without file lists (the agreement's) still proves whose copy it is."""
    c = _entry(pki)
    del c.files[:]
    assert pv.why_unproven(c, [pki["ca"]], NOW) is None  # type: ignore[list-item]
    c.step = 5
    assert "signature" in (pv.why_unproven(c, [pki["ca"]], NOW) or "")  # type: ignore[list-item]


def test_an_expired_certificate_proves_nothing(pki: dict[str, object]) -> None:
    later = NOW + datetime.timedelta(days=3)  # the test certificates last a day
    assert "does not chain" in (pv.why_unproven(_entry(pki), [pki["ca"]], later) or "")  # type: ignore[list-item]


def test_a_peer_inventory_keeps_its_own_steps_and_proven_copies_only(
        pki: dict[str, object]) -> None:
    """``drop_unproven``: rank 1's own step stands without a proof (its certificate
    is its identity); its copy of rank 0's data stands with rank 0's proof; a
    "copy" of rank 0's step it signed itself, or none signed, is dropped."""
    d = pki["dir"]
    assert isinstance(d, Path)
    crt, key = pki["rank1_files"]  # type: ignore[misc]
    check = pv.ProofCheck(Credentials(tls_cert=crt, tls_key=key, tls_ca=_ca_file(pki, d)))
    inv = pb.Inventory(rank=1)
    inv.copies.add(step=3, origin_rank=1)           # its own: kept
    inv.copies.append(_entry(pki))                   # rank 0's, proven: kept
    forged = _entry(pki, "rank1", 1)
    forged.origin_rank = 0                           # rank 0's, signed by rank 1
    inv.copies.append(forged)
    inv.copies.add(step=9, origin_rank=0)            # rank 0's, no proof
    gone = check.drop_unproven(inv)
    assert [(c.origin_rank, c.step) for c in inv.copies] == [(1, 3), (0, 777)]
    assert len(gone) == 2 and "names rank 1, not rank 0" in gone[0] and "no proof" in gone[1]
    # Remembered after one check, the files are still checked each time.
    again = _entry(pki)
    again.files[0].crc32c ^= 1
    assert "not the ones signed" in (check.why_not(again) or "")


def _ca_file(pki: dict[str, object], d: Path) -> Path:
    p = d / "ca.crt"
    if not p.exists():
        ca = pki["ca"]
        assert isinstance(ca, x509.Certificate)
        p.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    return p


def test_own_proofs_sign_a_step_with_the_ranks_key_and_the_holder_lists_it(
        pki: dict[str, object], tmp_path: Path) -> None:
    """The origin's :class:`OwnProofs` hashes a step's files and signs them with its
    certificate's key (read from its files); the holder keeps the signed entry beside
    the copy and lists it: the listing is proven, and :func:`not_signed` finds a
    file whose bytes changed."""
    d = pki["dir"]
    assert isinstance(d, Path)
    crt, key = pki["rank0_files"]  # type: ignore[misc]
    creds = Credentials(tls_cert=crt, tls_key=key, tls_ca=_ca_file(pki, d))
    step_dir = tmp_path / "777"
    for p, b in FILES.items():
        (step_dir / p).parent.mkdir(parents=True, exist_ok=True)
        (step_dir / p).write_bytes(b)
    metas = [FileMeta(p, len(b), file_crc(step_dir / p)[1]) for p, b in sorted(FILES.items())]
    signer = pv.Signer.of(creds)
    assert signer is not None
    own = OwnProofs(0, signer)
    try:
        c = own.entry(777, step_dir, metas, run="run-a", saved_hosts=2, saving_ranks=[0, 1],
                      sha256=file_sha256)
        assert own.entry(777, step_dir, metas, run="run-a", saved_hosts=2,
                         saving_ranks=[0, 1], sha256=lambda p: b"") is c  # remembered
    finally:
        own.close()
    check = pv.ProofCheck(creds)
    assert check.why_not(c) is None
    # The holder: kept beside its copy, put back on the entry it lists.
    replicas = tmp_path / "replicas"
    (replicas / "0" / "777").mkdir(parents=True)
    proof_path(replicas, 0, 777).write_bytes(c.SerializeToString())
    listed = pb.StepCopy(step=777, origin_rank=0, run="run-a", saved_hosts=2,
                         saving_ranks=[0, 1], fingerprint=c.fingerprint,
                         files=[pb.FileInfo(path=m.path, size=m.size, crc32c=m.crc32c)
                                for m in metas])
    HeldProofs(replicas).attach(listed, replicas / "0" / "777")
    assert check.why_not(listed) is None
    assert pv.not_signed(step_dir, listed) is None
    (step_dir / "d/b.bin").write_bytes(b"made up!" * 25)  # same size, other bytes
    assert pv.not_signed(step_dir, listed) == "d/b.bin"
    other = pb.StepCopy(fingerprint=c.fingerprint ^ 1)
    put_proof(other, c)  # another save under the number: its proof is not this one
    assert not other.proof.signature


def test_a_trainer_checks_proofs_where_it_reads_the_names_certificates_give(
        pki: dict[str, object]) -> None:
    """The trainer's peer reads check proofs when its own certificate names a rank or
    the controller's role as this process reads them (``mtc certs``); a pod's own
    certificate (its pod's name, read as a rank only by a replicator told the job's
    pod names) leaves the checks to the replicators; without TLS there are none."""
    d = pki["dir"]
    assert isinstance(d, Path)
    ca = _ca_file(pki, d)

    def creds(name: str) -> Credentials:
        crt, key = pki[name + "_files"]  # type: ignore[misc]
        return Credentials(tls_cert=crt, tls_key=key, tls_ca=ca)

    assert names_read_here(creds("rank0")) and names_read_here(creds("controller"))
    assert not names_read_here(creds("both"))  # names nobody here
    assert not names_read_here(Credentials(token="t")) and not names_read_here(None)


def _own_files() -> list[FileMeta]:
    return [FileMeta(p, len(b), len(b) * 7) for p, b in sorted(FILES.items())]


def _holding(*copies: pb.StepCopy, holder: int = 1) -> dict[int, pb.Inventory]:
    inv = pb.Inventory(rank=holder)
    inv.copies.extend(copies)
    return {holder: inv}


def _entry_with(pki: dict[str, object], change: Callable[[pb.StepCopy], None]) -> pb.StepCopy:
    c = _entry(pki)
    change(c)
    return c


SIGNED = {p: hashlib.sha256(b).digest() for p, b in FILES.items()}


@pytest.mark.parametrize(("name", "invs", "run", "want"), [
    ("a holder's proven copy of its data", lambda k: _holding(_entry(k)), "", SIGNED),
    ("of the agreed run", lambda k: _holding(_entry(k)), "run-a", SIGNED),
    ("of another run", lambda k: _holding(_entry(k)), "run-b", None),
    ("of another step", lambda k: _holding(_entry_with(k, _set("step", 778))), "", None),
    ("of another rank's data", lambda k: _holding(_entry(k, "rank1", 1)), "", None),
    ("listed by the rank itself", lambda k: _holding(_entry(k), holder=0), "", None),
    ("without a proof", lambda k: _holding(_entry_with(k, _no_proof)), "", None),
    ("without its files' SHA-256s", lambda k: _holding(_entry_with(k, _file(0, "sha256", b""))),
     "", None),
    ("of other files", lambda k: _holding(_entry_with(k, _file(0, "size", 1))), "", None),
    ("with a file less", lambda k: _holding(_entry_with(k, lambda c: c.files.pop())), "", None),
    ("none listed", lambda k: {}, "", None),
])
def test_what_healing_an_own_step_checks_against(
        pki: dict[str, object], name: str,
        invs: Callable[[dict[str, object]], dict[int, pb.Inventory]], run: str,
        want: dict[str, bytes] | None) -> None:
    """``own_signed``: the SHA-256s rank 0 signed for its own step 777, taken from a
    copy of its data another host lists with its proof, of exactly its files."""
    assert pv.own_signed(0, 777, _own_files(), invs(pki), run) == want, name


def test_healing_takes_no_list_whose_proof_fails(pki: dict[str, object]) -> None:
    """A listed proof the check refuses (here: every one) gives no list to check
    healed bytes against, whatever the entry says; nor do no files."""
    assert pv.own_signed(0, 777, _own_files(), _holding(_entry(pki)),
                         proven=lambda c: False) is None
    assert pv.own_signed(0, 777, [], _holding(_entry(pki))) is None


def _bogus(pki: dict[str, object], n: int, seed: int) -> pb.Inventory:
    """Rank 1's inventory listing ``n`` made-up copies of "rank 0's data": each with
    rank 0's real certificate and a random signature (issue 66, finding 4)."""
    import os

    real = _entry(pki)
    inv = pb.Inventory(rank=1)
    for i in range(n):
        c = inv.copies.add(step=1000 + i, origin_rank=0, saved_hosts=2, saving_ranks=[0, 1],
                           fingerprint=real.fingerprint)
        c.proof.CopyFrom(real.proof)
        c.proof.signature = os.urandom(70) + seed.to_bytes(2, "big")
    return inv


def test_made_up_copies_cost_the_gatherer_little(pki: dict[str, object]) -> None:
    """60,000 made-up copies of rank 0's data in one member's inventory (rank 0's
    real certificate, random signatures) had every gather check each one's chain and
    signature: the coordinator's CPU went to them and restores waited. Now an
    inventory listing more than 256 steps of one origin is refused whole, counted
    before any proof is checked; one within the bound costs at most 64 new proof
    checks per gather, the chain checked once; and a good proof is still taken."""
    import time

    from mtc.errors import ProtocolError
    from mtc.sidecar.replicator import checks

    d = pki["dir"]
    assert isinstance(d, Path)
    crt, key = pki["rank1_files"]  # type: ignore[misc]
    check = pv.ProofCheck(Credentials(tls_cert=crt, tls_key=key, tls_ca=_ca_file(pki, d)))
    flood = _bogus(pki, 60_000, 0)
    t0 = time.process_time()
    with pytest.raises(ProtocolError, match="more than 256"):
        checks.inventory(flood, rank=1, num_nodes=2)
    assert time.process_time() - t0 < 0.5
    for seed in range(1, 4):  # new signatures at every gather: nothing remembered helps
        inv = _bogus(pki, checks.MAX_STEPS_PER_ORIGIN, seed)
        checks.inventory(inv, rank=1, num_nodes=2)
        t0 = time.process_time()
        gone = check.drop_unproven(inv)
        spent = time.process_time() - t0
        assert not inv.copies and len(gone) == checks.MAX_STEPS_PER_ORIGIN
        assert sum("signature does not match" in g for g in gone) == pv.NEW_CHECKS_PER_INVENTORY
        assert spent < 0.25, spent  # about 64 signature checks; the chain's once
    good = pb.Inventory(rank=1, copies=[_entry(pki)])
    assert check.drop_unproven(good) == [] and len(good.copies) == 1
