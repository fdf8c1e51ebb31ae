"""``mtc``: operator commands.

    mtc status --local-dir DIR           committed steps, sizes, foreign step folders
                                         (not mtc's) and leftovers on a RAM disk
    mtc status --nodes ADDR0,ADDR1,...   every host's steps on every tier (via replicators)
    mtc backup --node ADDR               back up the newest complete step now
    mtc backup --nodes ADDR0,ADDR1,...   the same, asking the first that answers
    mtc certs --out DIR --ranks N        a CA, a certificate per replicator rank and
                                         the controller's, for mutual TLS

``status --nodes`` and ``backup`` reach the replicators with ``--token-file``, with
mutual TLS (``--tls-cert --tls-key --tls-ca``: a certificate of the job's CA that
names no rank, as the controller's), or both.

``status`` exits 1 when a node it was asked about is down or refuses this
command's credentials (said apart: REFUSED, with why), its configuration
disagrees with its peers', it cannot reach a peer (a wrong address in its
``--nodes``: nobody answers there), it lost steps its peers hold copies of
(a wiped RAM disk, a replaced host), or it misses steps every other node holds
and nobody holds a copy of (MISSING STEPS: wiped before they reached a peer).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mtc import layout
from mtc.errors import LocalDirError, MtcError

if TYPE_CHECKING:
    from mtc.credentials import Credentials


def _creds(args: argparse.Namespace) -> Credentials:
    from mtc.credentials import Credentials

    creds = Credentials.from_files(args.token_file, args.tls_cert, args.tls_key, args.tls_ca)
    creds.check_files()
    return creds


def _credential_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--token-file", help="file holding the replicators' shared token")
    p.add_argument("--tls-cert", help="certificate for mutual TLS (PEM; the controller's: "
                                      "one that names no rank)")
    p.add_argument("--tls-key", help="its private key (PEM)")
    p.add_argument("--tls-ca", help="the CA that signs the replicators' certificates (PEM)")


def _roots(local_dir: Path) -> list[Path]:
    """The host roots under ``local_dir``: its ``host-<i>`` folders, or itself."""
    if not local_dir.is_dir():
        raise LocalDirError("not a directory", path=str(local_dir))
    hosts = sorted((p for p in local_dir.iterdir()
                    if p.is_dir() and p.name.startswith("host-") and p.name[5:].isdigit()),
                   key=lambda p: int(p.name[5:]))
    return hosts or [local_dir]


def local_status(local_dir: Path, as_json: bool) -> int:
    """Read a RAM disk directly: no replicator, no JAX."""
    reports = [layout.inspect_root(r) for r in _roots(local_dir)]
    held = [set(r.steps) for r in reports]
    complete = sorted(set.intersection(*held)) if held else []
    if as_json:
        print(json.dumps({"local_dir": str(local_dir), "on_every_host": complete, "hosts": [
            {"root": str(r.root), "steps": {str(s): b for s, b in r.steps.items()},
             "foreign": {str(s): b for s, b in r.foreign.items()},
             "leftovers": r.leftovers} for r in reports]}, indent=2))
        return 0
    for r in reports:
        steps = ", ".join(f"{s} ({_size(b)})" for s, b in r.steps.items()) or "-"
        print(f"{r.root}: committed steps {steps}")
        for s, b in r.foreign.items():
            print(f"{r.root}: foreign step folder {s} ({_size(b)}): no mtc manifest "
                  f"(Orbax's or another tool's); mtc leaves it alone")
        for name, b in r.leftovers.items():
            print(f"{r.root}: uncommitted or unknown folder {name} ({_size(b)})")
    print(f"on every host: {complete if complete else '-'}")
    return 0


def _size(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    x = float(n)
    for unit in ("KiB", "MiB", "GiB"):
        x /= 1024
        if x < 1024 or unit == "GiB":
            break
    return f"{x:.1f} {unit}"


def _row(rank: int, addr: str, creds: Credentials) -> tuple[dict[str, Any], list[int]]:
    """One node as ``mtc status`` shows it, and its backed-up steps."""
    from mtc.replicas import inventory

    try:
        inv = inventory(addr, creds=creds, rank=rank)
        ident = inventory(addr, creds=creds, rank=rank, identify=True)
    except MtcError as e:  # unreachable, or refused (the client's PeerError)
        # Down, or listening but refusing this command's certificate (none, another
        # CA's): gRPC says "Socket closed" for both; the TLS handshake tells them apart.
        return {"rank": rank, "address": addr, "up": False, "error": str(e),
                "refused": credential_problem(addr, creds)}, []
    own = sorted(c.step for c in inv.copies if c.origin_rank == rank)
    peers: dict[int, list[int]] = defaultdict(list)
    for c in inv.copies:
        if c.origin_rank != rank:
            peers[c.origin_rank].append(c.step)
    return {"rank": rank, "address": addr, "up": True, "local": own,
            "peer_copies": {str(o): sorted(s) for o, s in sorted(peers.items())},
            "quarantined": inv.quarantined_files,
            "replication": _replication(ident),
            "config_error": ident.config_error,
            "unanswered_peers": [
                {"rank": p.rank, "address": p.address, "seconds": round(p.seconds, 1),
                 "error": p.error, "target": p.target}
                for p in ident.unanswered_peers]}, sorted(inv.backed_up_steps)


def _missing(rows: list[dict[str, Any]]) -> dict[int, list[int]]:
    return missing_steps({r["rank"]: r["local"] for r in rows if r["up"]},
                         {r["rank"]: {int(o): s for o, s in r["peer_copies"].items()}
                          for r in rows if r["up"]})


def _lost(rows: list[dict[str, Any]]) -> dict[int, dict[int, list[int]]]:
    return lost_steps({r["rank"]: r["local"] for r in rows if r["up"]},
                      {r["rank"]: {int(o): s for o, s in r["peer_copies"].items()}
                       for r in rows if r["up"]})


def status(nodes: list[str], creds: Credentials, as_json: bool) -> int:
    rows: list[dict[str, Any]] = []
    backed: list[int] = []
    for rank, addr in enumerate(nodes):
        row, steps = _row(rank, addr, creds)
        rows.append(row)
        backed = steps or backed
    lost = _lost(rows)
    if lost:
        # Read one after another: a step saved and copied meanwhile is newer than
        # its origin's listing. A lost one is still missing when its origin is read
        # again.
        for rank in lost:
            rows[rank] = _row(rank, nodes[rank], creds)[0]
        lost = _lost(rows)
    missing = _missing(rows)
    for r in rows:
        if r["rank"] in lost:
            r["lost"] = {str(s): h for s, h in lost[r["rank"]].items()}
            r["replication"] = "LOST its data"
        elif r["rank"] in missing:
            r["missing"] = missing[r["rank"]]
            r["replication"] = "MISSING steps"
    down = 1 if any(not r["up"] or r["config_error"] or r["unanswered_peers"] or r.get("lost")
                    or r.get("missing") for r in rows) else 0
    if as_json:
        print(json.dumps({"hosts": rows, "backup": backed}, indent=2))
        return down
    print(f"{'rank':>4}  {'address':<22} {'local steps':<20} {'replication':<22} "
          f"{'quarantined':<11} peer copies held")
    for r in rows:
        if not r["up"] and r["refused"]:
            print(f"{r['rank']:>4}  {r['address']:<22} REFUSED THIS COMMAND'S CREDENTIALS: "
                  f"{r['refused']}")
            continue
        if not r["up"]:
            print(f"{r['rank']:>4}  {r['address']:<22} DOWN: {r['error']}")
            continue
        peers_s = ", ".join(f"rank {o}: {s}" for o, s in r["peer_copies"].items()) or "-"
        print(f"{r['rank']:>4}  {r['address']:<22} {r['local']!s:<20} {r['replication']:<22} "
              f"{r['quarantined']:<11} {peers_s}")
    for r in rows:
        if r.get("config_error"):
            print(f"rank {r['rank']}: CONFIGURATION DISAGREES: {r['config_error']}")
        for p in r.get("unanswered_peers", ()):
            print(f"rank {r['rank']}: PEER UNREACHABLE: {unreachable(p)}")
        if r.get("lost"):
            steps = sorted(int(k) for k in r["lost"])
            holders = sorted({h for hs in r["lost"].values() for h in hs})
            has = f"its own steps {r['local']}" if r["local"] else "none of its own steps"
            print(f"rank {r['rank']}: LOST DATA: it holds {has} while rank(s) {holders} "
                  f"hold copies of its step(s) {steps}: its RAM disk was wiped or the host "
                  f"replaced; the job's next restore brings them back from there")
        if r.get("missing"):
            print(f"rank {r['rank']}: MISSING STEPS: it holds "
                  f"{r['local'] or 'none of its own steps'} while every other rank holds "
                  f"step(s) {r['missing']}, and no node holds a copy of its data of them: its "
                  f"RAM disk was wiped (or its host replaced) before they reached a peer; "
                  f"a restore goes back to an older step, or to the backup")
    print(f"backup: {backed if backed else '-'}")
    refused = sum(not r["up"] and bool(r["refused"]) for r in rows)
    if refused:
        print(f"mtc: {refused} of {len(rows)} nodes refused this command's credentials "
              f"(they are up: see above)", file=sys.stderr)
    gone = sum(not r["up"] and not r["refused"] for r in rows)
    if gone:
        print(f"mtc: {gone} of {len(rows)} nodes are down", file=sys.stderr)
    short = sum(bool(r.get("missing")) for r in rows)
    if short:
        print(f"mtc: {short} of {len(rows)} nodes miss steps the others hold",
              file=sys.stderr)
    cut = sum(bool(r.get("unanswered_peers")) for r in rows)
    if cut:
        print(f"mtc: {cut} of {len(rows)} nodes cannot reach a peer", file=sys.stderr)
    wiped = sum(bool(r.get("lost")) for r in rows)
    if wiped:
        print(f"mtc: {wiped} of {len(rows)} nodes lost their data", file=sys.stderr)
    wrong = sum(bool(r.get("config_error")) for r in rows)
    if wrong:
        print(f"mtc: {wrong} of {len(rows)} nodes disagree with a peer's configuration",
              file=sys.stderr)
    return down


def lost_steps(own: Mapping[int, Sequence[int]],
               copies: Mapping[int, Mapping[int, Sequence[int]]]
               ) -> dict[int, dict[int, list[int]]]:
    """The steps each rank lost: rank -> {step: the ranks holding a copy of it} for
    the copies of its data other nodes hold of steps newer than its own newest (a
    copy is made only of a step committed on its origin, and retention deletes the
    oldest first: a newer copy means the origin lost its steps, wiped or
    replaced). ``own``: each answering rank's own steps; ``copies``: holder ->
    origin -> steps. Pure."""
    out: dict[int, dict[int, list[int]]] = {}
    for holder, held in copies.items():
        for origin, steps in held.items():
            if origin == holder or origin not in own:
                continue
            newest = max(own[origin], default=-1)
            for s in steps:
                if s > newest:
                    out.setdefault(origin, {}).setdefault(s, []).append(holder)
    return {o: {s: sorted(h) for s, h in sorted(v.items())} for o, v in sorted(out.items())}


def missing_steps(own: Mapping[int, Sequence[int]],
                  copies: Mapping[int, Mapping[int, Sequence[int]]]) -> dict[int, list[int]]:
    """The steps each rank misses with no copy anywhere: rank -> the steps every other
    answering rank holds of its own, newer than the rank's newest, of which no node
    holds the rank's copy (a RAM disk wiped before its steps reached a peer: no
    copy tells :func:`lost_steps` of them). ``own``, ``copies``: as there. Pure."""
    out: dict[int, list[int]] = {}
    for rank, mine in own.items():
        others = [set(s) for o, s in own.items() if o != rank]
        if not others:
            continue
        newest = max(mine, default=-1)
        copied = {s for held in copies.values() for o, steps in held.items() if o == rank
                  for s in steps}
        gone = sorted(s for s in set.intersection(*others) if s > newest and s not in copied)
        if gone:
            out[rank] = gone
    return out


def credential_problem(addr: str, creds: Credentials, timeout_s: float = 2.0) -> str:
    """Why a node listening at ``addr`` refuses this command's credentials, in words
    ("": nothing listens there, or its TLS accepts them): no certificate given where
    it requires mutual TLS, its certificate not of ``--tls-ca``'s CA, ours refused,
    or TLS asked of a node that does not speak it."""
    import socket
    import ssl

    host, _, port = addr.rpartition(":")
    try:
        raw = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s)
    except (OSError, ValueError):
        return ""  # nothing listens: down
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False  # the chain is the question here, not the name
    ctx.set_alpn_protocols(["h2"])
    if creds.tls:
        assert creds.tls_cert and creds.tls_key and creds.tls_ca
        ctx.load_verify_locations(cafile=str(creds.tls_ca))
        ctx.load_cert_chain(str(creds.tls_cert), str(creds.tls_key))
    else:
        ctx.verify_mode = ssl.CERT_NONE
    try:
        with ctx.wrap_socket(raw, server_hostname=host.strip("[]")) as tls:
            tls.settimeout(min(timeout_s, 1.0))
            refused_ours = ("it listens, and refused this command's certificate: "
                            "--tls-cert must be signed by the job's CA" if creds.tls else
                            "it requires mutual TLS and no certificate was given: pass "
                            "--tls-cert, --tls-key and --tls-ca (a certificate of the "
                            "job's CA that names no rank, as the controller's)")
            try:
                # TLS 1.3: a refused client certificate is told here, by an alert or
                # by the connection closed; a node that accepts it waits for our bytes.
                if tls.recv(1) == b"":
                    return refused_ours
            except (ConnectionError, ssl.SSLEOFError):
                return refused_ours
            except ssl.SSLError as e:
                return (f"it listens, and refused this command's certificate "
                        f"({e.reason or e}): --tls-cert must be signed by the job's CA"
                        if creds.tls else
                        "it requires mutual TLS and no certificate was given: pass "
                        "--tls-cert, --tls-key and --tls-ca (a certificate of the job's CA "
                        "that names no rank, as the controller's)")
            except OSError:
                pass  # it waits for the client's first bytes: the handshake went through
    except ssl.SSLCertVerificationError as e:
        return (f"it listens, and its certificate is not signed by --tls-ca "
                f"{creds.tls_ca} ({e.verify_message}): another CA's; use the job's CA")
    except ssl.SSLError as e:
        plain = isinstance(e, ssl.SSLEOFError) or "WRONG_VERSION_NUMBER" in str(e)
        if creds.tls:
            return (f"it listens, and the TLS handshake failed ({e.reason or e}): "
                    + ("it does not speak TLS: leave out --tls-*" if plain else
                       "it refuses this command's certificate: --tls-cert must be "
                       "signed by the job's CA"))
        if plain:
            return ""  # no TLS asked, none spoken: not a credential question
        return ("it requires mutual TLS and no certificate was given: pass --tls-cert, "
                "--tls-key and --tls-ca (a certificate of the job's CA that names no rank, "
                "as the controller's)")
    except OSError:
        return ""
    finally:
        raw.close()
    if not creds.tls:
        return ("it requires mutual TLS and no certificate was given: pass --tls-cert, "
                "--tls-key and --tls-ca (a certificate of the job's CA that names no rank, "
                "as the controller's)")
    return ""


def unreachable(p: dict[str, Any]) -> str:
    """One peer a node cannot reach, in words (``mtc status``)."""
    why = ("its steps are not copied there" if p["target"]
           else "it is not this node's copy target")
    return (f"rank {p['rank']} at {p['address']} has not answered it for {p['seconds']:.0f}s "
            f"({why}): {p['error']}; if that address is wrong, fix the node's --nodes")


def _replication(ident: Any) -> str:
    """How a node's replication is doing, from its identity."""
    if ident.unreplicated_step < 0:
        return "up to date"
    word = "LATE" if ident.replication_late else "copying"
    return f"{word}: step {ident.unreplicated_step} {ident.unreplicated_seconds:.0f}s"


def backup(nodes: Sequence[str], creds: Credentials) -> int:
    """Ask the first of ``nodes`` that answers (any replicator of the job: the one
    asked has the others upload their data of the step) to back up now."""
    from mtc.grpc_errors import PeerError
    from mtc.replicas import request_backup

    for i, node in enumerate(nodes):
        try:
            step = request_backup(node, creds=creds, timeout_s=3600)
        except PeerError as e:
            if i + 1 == len(nodes) or not e.unreachable:
                raise
            print(f"mtc: {node} did not answer ({e}); asking {nodes[i + 1]}", file=sys.stderr)
            continue
        print(f"backed up step {step}" if step >= 0 else "nothing to back up")
        return 0
    return 1


def certs_doc() -> str:
    from mtc import certs as mod

    return mod.__doc__ or ""


def certs(args: argparse.Namespace) -> int:
    from mtc import certs as mod

    hosts = [h for h in args.hosts.split(",") if h] if args.hosts else []
    for path in mod.issue(Path(args.out), args.ranks, hosts=hosts,
                          controller_name=args.controller_name, days=args.days):
        print(path)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="mtc", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("status", help="every host's steps on every tier")
    where = s.add_mutually_exclusive_group(required=True)
    where.add_argument("--nodes", help="replicator addresses, in rank order")
    where.add_argument("--local-dir", help="a RAM disk (or the folder of host-<i> roots), "
                                            "read directly")
    _credential_flags(s)
    s.add_argument("--json", action="store_true")
    b = sub.add_parser("backup", help="back up the newest complete step now")
    which = b.add_mutually_exclusive_group(required=True)
    which.add_argument("--node", help="any replicator's address")
    which.add_argument("--nodes", help="the replicators' addresses, as status takes them: "
                                       "the first that answers is asked")
    _credential_flags(b)
    c = sub.add_parser("certs", help="a CA and certificates for mutual TLS (outside "
                                     "Kubernetes)", description=certs_doc())
    c.add_argument("--out", required=True, help="folder to write them to (files in it are "
                                                 "never replaced)")
    c.add_argument("--ranks", required=True, type=int, help="how many replicators")
    c.add_argument("--hosts", help="the address (DNS name or IP) each rank's host is "
                                   "dialled at, comma-separated in rank order (default: "
                                   "loopback only)")
    c.add_argument("--controller-name", default="mtc-controller",
                   help="subject of the controller's certificate, which names the "
                        "controller's role (the DNS name mtc-controller) and no rank "
                        "(default mtc-controller)")
    c.add_argument("--days", type=int, default=365, help="validity (default 365)")
    args = p.parse_args(argv)
    try:
        if args.cmd == "status" and args.local_dir:
            return local_status(Path(args.local_dir), args.json)
        if args.cmd == "status":
            return status(args.nodes.split(","), _creds(args), args.json)
        if args.cmd == "certs":
            return certs(args)
        return backup([args.node] if args.node else args.nodes.split(","), _creds(args))
    except (MtcError, OSError) as e:
        print(f"mtc: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())


