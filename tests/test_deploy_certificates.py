"""Deployment, certificates (offline): every pod gets a certificate from
cert-manager's CSI driver naming its rank as a peer checks it, a renewed CA keeps
its key, and certificates from Secrets (which cannot name a pod's rank) are refused."""

from __future__ import annotations

import datetime
import fnmatch
import re
from pathlib import Path
from typing import Any

import grpc
import pytest
from deploy_render import (
    CASES,
    JOBS,
    configure_module,
    containers,
    env_of,
    is_pathways,
    job_of,
    jobsets,
    mounts,
    pod_of,
    worker_env,
)
from tls_certs import health_server

from mtc.credentials import Credentials
from mtc.rank_names import CONTROLLER, PodNames, identity_of, ranks_named
from mtc.sidecar.replicator import healthcheck
from mtc.sidecar.replicator import main as replicator_main
from mtc.sidecar.replicator.k8s import (
    JobSetPlace,
    parse_args,
    replicator_argv,
)

# Every test here renders the overlays (kubectl kustomize) or runs the images' tools.
pytestmark = pytest.mark.process


# cert-manager's CSI driver fills in these variables in a volume's attributes and
# refuses a volume naming any other (os.Expand in its request generator).
CSI_VARIABLES = {"POD_NAME", "POD_NAMESPACE", "POD_UID", "SERVICE_ACCOUNT_NAME"}
# Key usages cert-manager knows (its KeyUsage values); the driver refuses others.
CERT_USAGES = {"signing", "digital signature", "content commitment", "key encipherment",
               "key agreement", "data encipherment", "cert sign", "crl sign",
               "encipher only", "decipher only", "any", "server auth", "client auth",
               "code signing", "email protection", "s/mime", "ipsec end system",
               "ipsec tunnel", "ipsec user", "timestamping", "ocsp signing"}
CSI = "csi.cert-manager.io/"


def certificate_volume(pod: dict[str, Any]) -> dict[str, str]:
    """The attributes of the pod's certificate volume, from cert-manager's CSI driver."""
    v = {v["name"]: v for v in pod["volumes"]}["replicator-tls"]
    assert v["csi"]["driver"] == "csi.cert-manager.io" and v["csi"]["readOnly"] is True
    attrs: dict[str, str] = v["csi"]["volumeAttributes"]
    for value in attrs.values():
        assert set(re.findall(r"\$\{([^}]*)\}", value)) <= CSI_VARIABLES, value
        assert "$" not in re.sub(r"\$\{[^}]*\}", "", value), value
    usages = {u.strip() for u in attrs[CSI + "key-usages"].split(",")}
    assert "client auth" in usages and usages <= CERT_USAGES, usages
    assert attrs[CSI + "key-algorithm"] == "ECDSA" and attrs[CSI + "key-size"] == "256"
    assert re.fullmatch(r"\d+h", attrs[CSI + "duration"])
    return attrs


def dns_names(attrs: dict[str, str], pod: str, namespace: str) -> list[str]:
    """The certificate's DNS names as the CSI driver fills them in for ``pod``."""
    value = attrs[CSI + "dns-names"].replace("${POD_NAME}", pod)
    return [n.strip() for n in value.replace("${POD_NAMESPACE}", namespace).split(",")]


def pod_name(job: str, index: int, suffix: str = "x7k2q") -> str:
    """The name Kubernetes gives pod ``index`` of Indexed Job ``job`` (its prefix cut
    to 58 characters, the index kept, as the Job controller does)."""
    tail = f"-{index}-"
    return (job + tail)[:58 - len(tail)] + tail + suffix if len(job + tail) > 58 \
        else job + tail + suffix


@pytest.mark.parametrize("case", CASES)
def test_every_pod_gets_a_certificate_naming_its_rank(
        case: str, rendered: dict[str, list[dict[str, Any]]]) -> None:
    """Each worker pod's certificate, as cert-manager's CSI driver issues it from the
    job's own CA, names that pod's rank the way its replicator reads names (with the
    flags mtc-replicator-k8s computes from the pod's environment: it refuses to
    start otherwise) and covers the name the controller dials; the controller's
    certificate names no rank and the controller's role."""
    docs = rendered[case]
    (js,) = jobsets(docs)
    name = js["metadata"]["name"]
    ns = js["metadata"].get("namespace", "default")
    issuers = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Issuer"}
    certs = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Certificate"}
    assert not [c for c in certs.values() if not c["spec"].get("isCA")], \
        "no certificate shared by pods: each pod's comes from the CSI driver"
    worker = job_of(js, "worker")
    slices, hosts = worker["replicas"], worker["template"]["spec"]["completions"]
    pod = pod_of(worker)
    attrs = certificate_volume(pod)
    assert {u.strip() for u in attrs[CSI + "key-usages"].split(",")} >= {"server auth",
                                                                         "client auth"}
    # Signed by the job's own CA Issuer (a CA shared with another job would make that
    # job's pods ranks here), whose CA cert-manager makes.
    assert attrs[CSI + "issuer-name"] == f"{name}-ca"
    assert attrs.get(CSI + "issuer-kind", "Issuer") == "Issuer"
    issuer = issuers[attrs[CSI + "issuer-name"]]
    (ca,) = [c for c in certs.values()
             if c["spec"]["secretName"] == issuer["spec"]["ca"]["secretName"]]
    assert ca["spec"]["isCA"] is True
    assert "selfSigned" in issuers[ca["spec"]["issuerRef"]["name"]]["spec"]
    # Its files (0440, group fs-group) are readable by every container mounting them.
    group = int(attrs[CSI + "fs-group"])
    for c in containers(pod).values():
        if "replicator-tls" in mounts(c):
            sc = c["securityContext"]
            assert sc["runAsUser"] == 0 or sc["runAsGroup"] == group, c["name"]

    rep = containers(pod)["replicator"]
    renv = {k: v for k, v in env_of(rep).items() if isinstance(v, str)}
    pods = None
    for s in range(slices):
        for h in range(hosts):
            # The pod's environment as the downward API fills it in, and the command
            # line mtc-replicator-k8s makes of it.
            place = JobSetPlace.from_env(worker_env(
                JOBSET_NAME=name, JOB_INDEX=str(s), JOB_COMPLETION_INDEX=str(h),
                MTC_NUM_SLICES=str(slices), MTC_HOSTS_PER_SLICE=renv["MTC_HOSTS_PER_SLICE"]))
            rargs, rest = parse_args([*rep["args"]], env=renv)
            parsed = replicator_main.parse_args(replicator_argv(rargs, rest, place))
            pods = PodNames(parsed.tls_pod_prefix, parsed.tls_hosts_per_slice)
            names = dns_names(attrs, pod_name(f"{name}-worker-{s}", h), ns)
            assert ranks_named(names, pods) == {parsed.rank} == {s * hosts + h}, names
            # The name the controller and the health mirror dial: one wildcard label.
            host = place.hostname(place.rank)
            assert any(fnmatch.fnmatch(host, n) and n.count(".") == host.count(".")
                       for n in names), (host, names)
            assert f"*.{name}.{ns}.svc" in names
    assert pods is not None
    # Another pod of the same slot (a replacement) is the same rank; another job's is none.
    assert ranks_named(dns_names(attrs, pod_name(f"{name}-worker-0", 0, "bbbbb"), ns),
                       pods) == {0}
    assert ranks_named(dns_names(attrs, pod_name(f"x{name}-worker-0", 0), ns), pods) == set()

    if is_pathways(js):
        head = pod_of(job_of(js, "pathways-head"))
        hattrs = certificate_volume(head)
        assert hattrs[CSI + "issuer-name"] == attrs[CSI + "issuer-name"]
        names = dns_names(hattrs, pod_name(f"{name}-pathways-head-0", 0), ns)
        assert ranks_named(names, pods) == set(), names   # the controller: no rank,
        assert identity_of(names) == CONTROLLER, names    # but the controller's role
        assert "server auth" not in hattrs[CSI + "key-usages"]
        trainer = containers(head)["trainer"]
    else:
        # Multi-controller: each trainer uses its pod's certificate, naming its rank.
        trainer = containers(pod)["trainer"]
    assert env_of(trainer)["MTC_TLS_DIR"] == mounts(trainer)["replicator-tls"]


def _hours(duration: str) -> int:
    m = re.fullmatch(r"(\d+)h", duration)
    assert m, duration
    return int(m.group(1))


def test_a_renewed_ca_keeps_its_key(rendered: dict[str, list[dict[str, Any]]],
                                    tmp_path: Path) -> None:
    """cert-manager renews the job's CA with the same key, and before any pod's
    certificate could outlive the old CA certificate: a pod still trusting the old
    one accepts certificates the renewed one signs, so a CA renewal splits no pods
    (docs/operations.md, "Certificates")."""
    for case in CASES:
        docs = rendered[case]
        (ca,) = [d for d in docs if d["kind"] == "Certificate" and d["spec"].get("isCA")]
        assert ca["spec"]["privateKey"]["rotationPolicy"] == "Never", case
        (js,) = jobsets(docs)
        life = _hours(certificate_volume(pod_of(job_of(js, "worker")))[CSI + "duration"])
        assert _hours(ca["spec"]["renewBefore"]) >= life, case

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from tls_certs import issue, make_ca

    old_pem, key = make_ca("mtc-train-ca")
    old = x509.load_pem_x509_certificate(old_pem)
    now = datetime.datetime.now(datetime.UTC)
    renewed = (x509.CertificateBuilder().subject_name(old.subject).issuer_name(old.subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=1))
               .not_valid_after(now + datetime.timedelta(days=2))
               .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
               .sign(key, hashes.SHA256())).public_bytes(serialization.Encoding.PEM)

    def creds(name: str, files: dict[str, bytes]) -> Credentials:
        folder = tmp_path / name
        folder.mkdir()
        for n, data in {**files, "ca.crt": old_pem}.items():  # trusting the old CA
            (folder / n).write_bytes(data)
        return Credentials(tls_cert=folder / "tls.crt", tls_key=folder / "tls.key",
                           tls_ca=folder / "ca.crt")

    served = creds("server", issue((renewed, key), "mtc-train-worker-0-0-abcde",
                                   dns=("mtc-train-worker-0-0-abcde", "*.mtc-train")))
    renewed_pod = creds("renewed", issue((renewed, key), "mtc-train-worker-1-0-bcdef"))
    new_key_pod = creds("new-key", issue(make_ca("mtc-train-ca"), "mtc-train-worker-1-0-cdefg"))
    with health_server(served) as (port, _):
        address, name = f"127.0.0.1:{port}", "mtc-train-worker-0-0.mtc-train"
        assert healthcheck.check(address, creds=renewed_pod, tls_name=name) == "SERVING"
        with pytest.raises(grpc.RpcError):  # a CA with another key is another CA
            healthcheck.check(address, creds=new_key_pod, tls_name=name, timeout_s=2)


def test_secret_certificates_are_refused() -> None:
    """A job file of the shared-Secret days: one certificate cannot name each host's
    rank, so it is refused by key, saying what to do."""
    configure = configure_module()
    data = {**JOBS["job-multi-controller"], "certificates": "secret"}
    with pytest.raises(configure.JobFileError,
                       match=r"job\.yaml: certificates: 'secret' .* must name its rank"):
        configure.Job(data, "job.yaml")
