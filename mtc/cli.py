"""``mtc``: operator commands against running replicators.

    mtc status --nodes ADDR0,ADDR1,...   every host's steps on every tier
    mtc backup --node ADDR               back up the newest complete step now
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from typing import Any

from mtc.errors import MtcError
from sidecar.replicator.security import Credentials


def _creds(token_file: str | None) -> Credentials:
    return Credentials.from_files(token_file, None, None, None)


def status(nodes: list[str], token_file: str | None, as_json: bool) -> int:
    from mtc.proto import replicator_pb2 as pb
    from sidecar.replicator.client import PeerClient, PeerError

    rows: list[dict[str, Any]] = []
    backed: list[int] = []
    for rank, addr in enumerate(nodes):
        client = PeerClient(addr, _creds(token_file), rank=rank, deadline_s=5.0)
        try:
            inv = client.call("GetInventory", pb.InventoryRequest(), attempts=1)
        except PeerError as e:
            rows.append({"rank": rank, "address": addr, "up": False, "error": str(e)})
            continue
        finally:
            client.close()
        own = sorted(c.step for c in inv.copies if c.origin_rank == rank)
        peers: dict[int, list[int]] = defaultdict(list)
        for c in inv.copies:
            if c.origin_rank != rank:
                peers[c.origin_rank].append(c.step)
        backed = sorted(inv.backed_up_steps) or backed
        rows.append({"rank": rank, "address": addr, "up": True, "local": own,
                     "peer_copies": {str(o): sorted(s) for o, s in sorted(peers.items())},
                     "quarantined": inv.quarantined_files})
    if as_json:
        print(json.dumps({"hosts": rows, "backup": backed}, indent=2))
        return 0
    print(f"{'rank':>4}  {'address':<22} {'local steps':<20} {'quarantined':<11} "
          "peer copies held")
    for r in rows:
        if not r["up"]:
            print(f"{r['rank']:>4}  {r['address']:<22} DOWN: {r['error']}")
            continue
        peers_s = ", ".join(f"rank {o}: {s}" for o, s in r["peer_copies"].items()) or "-"
        print(f"{r['rank']:>4}  {r['address']:<22} {r['local']!s:<20} "
              f"{r['quarantined']:<11} {peers_s}")
    print(f"backup: {backed if backed else '-'}")
    return 0


def backup(node: str, token_file: str | None) -> int:
    from mtc.proto import replicator_pb2 as pb
    from sidecar.replicator.client import PeerClient

    client = PeerClient(node, _creds(token_file), rank=-1)
    try:
        reply = client.call("RequestBackup", pb.BackupRequest(step=-1), deadline_s=3600,
                            attempts=1)
    finally:
        client.close()
    print(f"backed up step {reply.step}" if reply.step >= 0 else "nothing to back up")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="mtc", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("status", help="every host's steps on every tier")
    s.add_argument("--nodes", required=True, help="replicator addresses, in rank order")
    s.add_argument("--token-file")
    s.add_argument("--json", action="store_true")
    b = sub.add_parser("backup", help="back up the newest complete step now")
    b.add_argument("--node", required=True, help="any replicator's address")
    b.add_argument("--token-file")
    args = p.parse_args(argv)
    try:
        if args.cmd == "status":
            return status(args.nodes.split(","), args.token_file, args.json)
        return backup(args.node, args.token_file)
    except (MtcError, OSError) as e:
        print(f"mtc: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())


