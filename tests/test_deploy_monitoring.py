"""Deployment, monitoring (offline): every pod's metrics port is declared, scraped
and let in by the NetworkPolicy; the alert rules are one set, each with its
runbook in docs/operations.md, and read only series a replicator exports; the
disruption budget takes one host at a time."""

from __future__ import annotations

import re
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_render import (
    CASES,
    DEPLOY,
    JOBS,
    REPO,
    arg,
    containers,
    job_of,
    jobsets,
    one,
    pod_of,
)
from prometheus_client.parser import text_string_to_metric_families

from mtc.testing.waits import wait_until

# Every test here renders the overlays (kubectl kustomize) or runs the images' tools.
pytestmark = pytest.mark.process


@pytest.mark.parametrize("case", CASES)
def test_metrics_are_declared_scraped_and_let_in(
        case: str, rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered[case]
    (js,) = jobsets(docs)
    name = js["metadata"]["name"]
    pod = pod_of(job_of(js, "worker"))
    rep = containers(pod)["replicator"]
    port = {p["name"]: p["containerPort"] for p in rep["ports"]}["metrics"]
    assert arg(rep, "--metrics-port") == str(port)
    assert arg(rep, "--metrics-address") == "0.0.0.0"
    # Worker pods carry these labels (JobSet sets them).
    labels = {"jobset.sigs.k8s.io/jobset-name": name,
              "jobset.sigs.k8s.io/replicatedjob-name": "worker"}
    kinds = {d["kind"] for d in docs}
    scraper_namespaces = set()
    if "PodMonitoring" in kinds:
        pm = one(docs, "PodMonitoring")
        assert pm["spec"]["selector"]["matchLabels"] == labels
        assert [e["port"] for e in pm["spec"]["endpoints"]] == ["metrics"]
        assert {t["to"] for t in pm["spec"]["targetLabels"]["fromPod"]} >= {"jobset"}
        scraper_namespaces.add("gmp-system")
    if "ServiceMonitor" in kinds:
        svc, sm = one(docs, "Service"), one(docs, "ServiceMonitor")
        assert svc["spec"]["selector"] == labels
        assert svc["spec"]["ports"][0]["targetPort"] == "metrics"
        assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
        assert [e["port"] for e in sm["spec"]["endpoints"]] == [svc["spec"]["ports"][0]["name"]]
        assert {r["targetLabel"] for r in sm["spec"]["endpoints"][0]["relabelings"]} >= \
            {"jobset"}
        scraper_namespaces.add(JOBS[case]["monitoringNamespace"] if case in JOBS
                               else "monitoring")
    if case in JOBS and JOBS[case].get("monitoring") == "none":
        assert not kinds & {"PodMonitoring", "Rules", "ServiceMonitor", "PrometheusRule"}
    if case in JOBS and JOBS[case].get("monitoring") == "prometheus-operator":
        assert not kinds & {"PodMonitoring", "Rules"}, "GMP's objects need GMP's CRDs"
    # The NetworkPolicy lets each scraper's namespace reach the metrics port, and only it.
    allowed = set()
    for rule in one(docs, "NetworkPolicy")["spec"]["ingress"]:
        if port in {p["port"] for p in rule.get("ports", [])}:
            for peer in rule["from"]:
                allowed.add(peer["namespaceSelector"]["matchLabels"][
                    "kubernetes.io/metadata.name"])
    assert scraper_namespaces <= allowed


def alert_groups(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for kind in ("Rules", "PrometheusRule"):
        found = [d for d in docs if d["kind"] == kind]
        if found:
            return list(found[0]["spec"]["groups"])
    return []


def test_alert_rules_are_one_set_with_runbooks(
        rendered: dict[str, list[dict[str, Any]]]) -> None:
    gmp = yaml.safe_load((DEPLOY / "components/monitoring-gmp/rules.yaml").read_text())
    prom = yaml.safe_load(
        (DEPLOY / "components/monitoring-prometheus/prometheusrule.yaml").read_text())
    assert gmp["spec"]["groups"] == prom["spec"]["groups"], "the two rule sets differ"
    rules = [r for g in gmp["spec"]["groups"] for r in g["rules"]]
    alerts = {r["alert"] for r in rules}
    # Replication lag, backup age, quarantined files, failures.
    assert alerts >= {"MtcReplicationLagging", "MtcBackupStale", "MtcNoBackup",
                      "MtcFilesQuarantined", "MtcReplicatorFailing", "MtcConfigMismatch"}
    runbook = (REPO / "docs" / "operations.md").read_text()
    headings = {re.sub(r"[^a-z0-9-]", "", h.strip().lower().replace(" ", "-"))
                for h in re.findall(r"^#+ (.+)$", runbook, re.M)}
    for r in rules:
        anchor = r["annotations"]["runbook"]
        assert anchor == f"docs/operations.md#{r['alert'].lower()}", anchor
        assert r["alert"].lower() in headings, f"no runbook entry for {r['alert']}"
        assert r["labels"]["severity"] in ("warning", "critical")
    # The shipped overlays and the jobs that ask for it carry the rules.
    for case in ("pathways", "multi-controller", "job-pathways"):
        assert alert_groups(rendered[case]) == gmp["spec"]["groups"], case


def test_backup_alerts_count_the_interval_they_are_given() -> None:
    """A backup interval is in minutes or in steps (``backupIntervalSteps``): each
    backup alert reads both, so that neither interval leaves it silent (with steps
    only, ``mtc_backup_interval_seconds`` is 0 and its clause never holds)."""
    rules = yaml.safe_load((DEPLOY / "components/monitoring-gmp/rules.yaml").read_text())
    by_name = {r["alert"]: r["expr"] for g in rules["spec"]["groups"] for r in g["rules"]}
    for name in ("MtcBackupStale", "MtcNoBackup"):
        assert "mtc_backup_interval_seconds" in by_name[name], name
        assert "mtc_backup_interval_steps" in by_name[name], name
        assert "or" in by_name[name].split(), name  # either interval makes it hold
    assert 'mtc_newest_step{state="backed_up"}' in by_name["MtcBackupStale"]


@pytest.mark.parametrize("interval", ["minutes", "steps"])
def test_alerts_read_what_a_replicator_exports(tmp_path: Path, interval: str) -> None:
    """Every series the alert rules read is on a real replicator's metrics port, the
    interval the alerts compare with is the one it was given (minutes or steps), and
    the backup-age series move when a backup is committed."""
    from replicators import Cluster

    rules = yaml.safe_load((DEPLOY / "components/monitoring-gmp/rules.yaml").read_text())
    exprs = " ".join(r["expr"] for g in rules["spec"]["groups"] for r in g["rules"])
    wanted = set(re.findall(r"\bmtc_[a-z_]+", exprs))
    given = ("--backup-interval-minutes", "30") if interval == "minutes" else \
        ("--backup-interval-steps", "2")
    cl = Cluster(tmp_path, 1, 1, metrics=True,
                 extra=("--replicas", "0", "--backup", (tmp_path / "bucket").as_uri(), *given))
    try:
        cl.start_all()
        before = cl.scrape(0)
        # Families, with or without samples yet (a labelled counter has none until used).
        with urllib.request.urlopen(f"http://127.0.0.1:{cl.metrics_ports[0]}/metrics",
                                    timeout=5) as r:
            families = list(text_string_to_metric_families(r.read().decode()))
        names = {f.name + ("_total" if f.type == "counter" else "") for f in families}
        assert wanted <= names, wanted - names
        # docs/operations.md's metrics table has a row for every series mtc exports.
        table = (REPO / "docs" / "operations.md").read_text().split("## Alerts")[0]
        listed = set(re.findall(r"`(mtc_[a-z_]+)", table))
        for full, tail in re.findall(r"`(mtc_[a-z_]+)`, `(_[a-z_]+)`", table):
            listed.add(full.rsplit("_", 2)[0] + tail)  # `mtc_x_sent_total`, `_received_total`
        # (A counter's ``_created`` series is the client library's, not a metric of its own.)
        mtc_names = {n for n in names if n.startswith("mtc_") and not n.endswith("_created")}
        assert mtc_names <= listed, f"not in docs/operations.md: {sorted(mtc_names - listed)}"
        assert (before["mtc_backup_interval_seconds"], before["mtc_backup_interval_steps"]) \
            == ((1800, 0) if interval == "minutes" else (0, 2))
        assert before["mtc_backup_last_success_timestamp_seconds"] == 0
        cl.commit(0, 4, {"a.bin": b"x" * 1024})
        client = cl.client(0)
        try:
            from mtc.proto import replicator_pb2 as pb

            wait_until("a backup of step 4", lambda: client.call(
                "RequestBackup", pb.BackupRequest(step=-1), deadline_s=30).step == 4, 30,
                poll_s=0.2)
        finally:
            client.close()
        after = cl.scrape(0)
        assert after["mtc_newest_step{state=backed_up}"] == 4
        assert abs(after["mtc_backup_last_success_timestamp_seconds"] - time.time()) < 60
    finally:
        cl.stop_all()


@pytest.mark.parametrize("case", CASES)
def test_disruptions_take_one_host_at_a_time(
        case: str, rendered: dict[str, list[dict[str, Any]]]) -> None:
    """Host h of two slices disrupted together loses both copies of rank h's newest
    step; one host down fails its slice: at most one slice is disrupted at a time."""
    docs = rendered[case]
    (js,) = jobsets(docs)
    worker = job_of(js, "worker")
    pods = worker["replicas"] * worker["template"]["spec"]["completions"]
    pdb = one(docs, "PodDisruptionBudget")
    assert pdb["spec"]["minAvailable"] == pods - 1
    assert "maxUnavailable" not in pdb["spec"], "Jobs have no scale subresource"
    assert pdb["spec"]["selector"]["matchLabels"] == {
        "jobset.sigs.k8s.io/jobset-name": js["metadata"]["name"],
        "jobset.sigs.k8s.io/replicatedjob-name": "worker"}
