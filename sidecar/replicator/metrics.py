"""Prometheus metrics of one replicator, and the HTTP server its scrapes reach."""

from __future__ import annotations

import socket
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, make_wsgi_app

from mtc.lifecycle import Threads


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.bytes_sent = Counter("mtc_replicated_bytes_sent", "Bytes pushed to peers",
                                  registry=r)
        self.bytes_received = Counter("mtc_replicated_bytes_received",
                                      "Verified bytes received from peers", registry=r)
        self.bytes_fetched = Counter("mtc_restore_bytes_fetched",
                                     "Verified bytes fetched from peers to restore", registry=r)
        self.backup_bytes = Counter("mtc_backup_bytes_uploaded",
                                    "Bytes this host uploaded to the backup store", registry=r)
        self.backup_bytes_downloaded = Counter(
            "mtc_backup_bytes_downloaded", "Verified bytes read from the backup store",
            registry=r)
        self.deduplicated_files = Counter("mtc_deduplicated_files",
                                          "Files a peer already held; only metadata moved",
                                          registry=r)
        self.quarantined = Counter("mtc_quarantined_files",
                                   "Files that failed verification, moved aside", registry=r)
        self.healed = Counter("mtc_healed_files",
                              "Bad files replaced by a verified copy from another holder",
                              registry=r)
        self.scrub_bytes = Counter("mtc_scrub_bytes",
                                   "Bytes of held copies read again by the background scrub",
                                   registry=r)
        self.scrub_damaged = Counter("mtc_scrub_damaged_files",
                                     "Bad files the background scrub found (then quarantined)",
                                     registry=r)
        self.copied_again = Counter(
            "mtc_steps_copied_again",
            "Older kept steps pushed to a peer that lacked them, by why: it had lost its "
            "copy (lost), or a newer step went first (late)", ["why"], registry=r)
        self.unproven = Counter(
            "mtc_unproven_copies",
            "Copies of another rank's data a peer listed or offered without a valid proof "
            "that rank made them (mutual TLS): ignored", registry=r)
        self.newest = Gauge("mtc_newest_step", "Newest step by state", ["state"], registry=r)
        self.lag = Gauge("mtc_replication_lag_steps",
                         "Committed steps newer than the newest fully replicated one",
                         registry=r)
        self.failures = Counter("mtc_failures", "Failures by kind", ["kind"], registry=r)
        self.skipped = Counter("mtc_skipped", "Work skipped without failing, by reason",
                               ["reason"], registry=r)
        self.unreplicated = Gauge("mtc_unreplicated_seconds",
                                  "How long this host's newest steps have waited to reach "
                                  "every peer (0: they are there)", registry=r)
        self.reserve_bytes = Gauge("mtc_reserve_bytes",
                                   "Blank RAM-disk bytes set aside for the next peer copies "
                                   "and a replaced host's restore",
                                   registry=r)
        self.reserve_used = Counter("mtc_reserve_files_used",
                                    "Received files written into space set aside for them",
                                    registry=r)
        self.config_mismatch = Gauge("mtc_config_mismatch",
                                     "1 when this node's --nodes, --rank or --nodes-per-slice "
                                     "disagree with a peer's", registry=r)
        # For alerts on the backup's age (deploy/components/monitoring-*): only the
        # backup leader commits backups, so the job's newest is the maximum over nodes.
        self.backup_committed = Gauge(
            "mtc_backup_last_success_timestamp_seconds",
            "Unix time this node, leading, last committed a backup (0: none since it started)",
            registry=r)
        self.backup_interval = Gauge(
            "mtc_backup_interval_seconds",
            "The time between backups this node was given (0: by steps only, or no backup)",
            registry=r)
        # The alerts on backup age read one or the other (deploy/components/*/rules).
        self.backup_interval_steps = Gauge(
            "mtc_backup_interval_steps",
            "The steps between backups this node was given (0: by time only, or no backup)",
            registry=r)
        self.stalled = Gauge("mtc_loop_stalled",
                             "1 while the replication loop has not passed for too long",
                             registry=r)
        # What tests wait on before asserting that a pass did not do something.
        self.passes = Counter("mtc_loop_passes",
                              "Passes a loop finished without failing, by loop "
                              "(replication, backup)", ["loop"], registry=r)
        # What tests wait on before acting on a restore that waits for its decision.
        self.restores_waiting = Gauge("mtc_restores_waiting",
                                      "Restores on this node waiting for their "
                                      "coordinator's decision", registry=r)
        self.decide_calls = Counter("mtc_decide_calls",
                                    "Decide calls this node made to its coordinator (a long "
                                    "wait takes several)", registry=r)
        for state in ("committed", "replicated", "backed_up"):
            self.newest.labels(state).set(-1)



class _Scrapes(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a scrape (its own short thread) never holds the shutdown


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass  # a scrape every few seconds is not news


class MetricsServer:
    """``metrics`` served on ``addr:port`` for Prometheus, a service
    (:class:`mtc.lifecycle.Service`): bound at once (a port taken fails before
    anything serves), its accept loop on a thread of the process's group (each
    scrape on a short thread of socketserver's, as prometheus_client's own)."""

    def __init__(self, metrics: Metrics, port: int, addr: str = "127.0.0.1") -> None:
        server = type("Scrapes", (_Scrapes,), {
            "address_family": socket.AF_INET6 if ":" in addr else socket.AF_INET})
        self._httpd: WSGIServer = make_server(addr.strip("[]"), port,
                                              make_wsgi_app(metrics.registry), server,
                                              handler_class=_Quiet)
        self.port: int = self._httpd.server_address[1]
        self._serving = False

    def start(self, threads: Threads) -> None:
        threads.start(self._httpd.serve_forever, "mtc-metrics", 0.2)
        self._serving = True

    def stop(self) -> None:
        if self._serving:
            self._httpd.shutdown()  # serve_forever returns within its 0.2 s poll

    def close(self) -> None:
        self._httpd.server_close()
