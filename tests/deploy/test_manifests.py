#!/usr/bin/env python3
"""deploy/Containerfile and deploy/k8s/*.yaml checked for what a GPU fleet needs,
without a container runtime or a cluster (no image is built here: a real
build and a kubeconform run are owed where those exist).

Containerfile: a CUDA devel build stage with NCCL that builds spd with CUDA,
into a runtime stage from CUDA's base image with no compiler and no headers,
that installs NCCL, copies only the installed tree and runs as a numeric
non-root user it creates; no health check that takes a session slot.

DaemonSet: GPU nodes only (nodeSelector, tolerations), system-node-critical,
OnDelete updates, probes on GET /healthz at the port spd's own configuration
serves, every capability dropped but those spd uses, a seccomp profile, no
privilege escalation, a pinned image of this release and the Containerfile's
CUDA, GPUs without claiming them and an RDMA resource, scrape annotations, a
headless Service and a ServiceMonitor that find it; and spd --check-config
accepts its configuration.

Usage: test_manifests.py SOURCE_DIR SPD
"""
import os
import re
import subprocess
import sys
import tempfile

import yaml

SRC, SPD = sys.argv[1], sys.argv[2]


def fail(msg):
    print(f"FAIL: {msg}")
    sys.exit(1)


def check(cond, msg):
    if not cond:
        fail(msg)


# ---------------------------------------------------------------- Containerfile

def containerfile_instructions(text):
    """(instruction, arguments) per instruction, continuation lines joined,
    comments dropped."""
    out, cur = [], ""
    for line in text.splitlines():
        s = line.strip()
        if not cur and (not s or s.startswith("#")):
            continue
        if s.startswith("#"):
            continue
        cur += " " + s.rstrip("\\").strip() if cur else s.rstrip("\\").strip()
        if not s.endswith("\\"):
            word, _, rest = cur.partition(" ")
            out.append((word.upper(), rest.strip()))
            cur = ""
    return out


def apt_packages(run_args):
    m = re.search(r"apt-get install -y --no-install-recommends (.*?)(&&|$)", run_args)
    return m.group(1).split() if m else []


def test_containerfile():
    text = open(os.path.join(SRC, "deploy", "Containerfile")).read()
    ins = containerfile_instructions(text)
    args = {a.split("=", 1)[0]: a.split("=", 1)[1] for i, a in ins if i == "ARG" and "=" in a}
    stages, cur = [], None
    for i, a in ins:
        if i == "FROM":
            cur = {"from": a, "ins": []}
            stages.append(cur)
        elif cur is not None:
            cur["ins"].append((i, a))
    check(len(stages) == 2, f"{len(stages)} stages; want a build stage and a runtime stage")
    build, runtime = stages
    cuda = args.get("CUDA_VERSION")
    check(cuda and re.fullmatch(r"\d+\.\d+\.\d+", cuda), f"CUDA_VERSION is not pinned to x.y.z: {cuda}")
    check(re.fullmatch(r"nvidia/cuda:\$\{CUDA_VERSION\}-devel-\S+ AS build", build["from"]),
          f"the build stage is not CUDA's devel image: FROM {build['from']}")
    check(re.fullmatch(r"nvidia/cuda:\$\{CUDA_VERSION\}-base-\S+", runtime["from"]),
          f"the runtime stage is not CUDA's base image (no compiler, no headers): FROM {runtime['from']}")
    check(build["from"].split("-devel-")[1].split()[0] == runtime["from"].split("-base-")[1],
          "the two stages are of different distributions")

    build_runs = " ".join(a for i, a in build["ins"] if i == "RUN")
    check("libnccl-dev" in apt_packages(build_runs), "the build stage does not install NCCL's headers (libnccl-dev)")
    check("-DSP_WITH_CUDA=ON" in build_runs and "SP_WITH_CUDA=OFF" not in text, "spd is not built with CUDA")
    check("spd: CUDA ON, NCCL ON" in build_runs, "the build does not stop when CMake finds no CUDA or no NCCL")

    rt_runs = [a for i, a in runtime["ins"] if i == "RUN"]
    pkgs = [p for r in rt_runs for p in apt_packages(r)]
    check("libnccl2" in pkgs, "the runtime stage does not install NCCL (libnccl2)")
    tools = [p for p in pkgs if p.endswith("-dev") or p in ("gcc", "g++", "cmake", "ninja-build", "cuda-nvcc")]
    check(not tools, f"the runtime stage installs build tools or headers: {tools}")
    copies = [a for i, a in runtime["ins"] if i == "COPY"]
    check(any(a.startswith("--from=build /opt/spd ") for a in copies), "the runtime stage does not take /opt/spd")
    check(all(a.startswith("--from=build /opt/spd ") or not a.startswith("--from") for a in copies),
          "the runtime stage copies more than the installed tree from the build")

    users = [a for i, a in runtime["ins"] if i == "USER"]
    check(len(users) == 1, "the runtime stage has no USER")
    uid, _, gid = users[0].partition(":")
    check(uid.isdigit() and int(uid) != 0 and gid.isdigit() and int(gid) != 0,
          f"USER {users[0]}: want a numeric uid:gid other than root's (runAsNonRoot can check only numbers)")
    rt = " ".join(rt_runs)
    check(re.search(rf"useradd .*--uid {uid} ", rt) and re.search(rf"groupadd .*--gid {gid} ", rt),
          f"the runtime stage does not create uid {uid} and gid {gid}")
    check(re.search(rf"install -d -o \S+ -g \S+ -m 0710 /run/spd", rt),
          "the socket directory is not made for the user")

    entry = [a for i, a in runtime["ins"] if i == "ENTRYPOINT"]
    check(entry == ['["spd", "--config", "/etc/spd/spd.conf"]'], f"ENTRYPOINT {entry}")
    check(not [a for i, a in runtime["ins"] if i == "HEALTHCHECK" and "spctl" in a],
          "a HEALTHCHECK through spctl takes a session slot")
    env = " ".join(a for i, a in runtime["ins"] if i == "ENV")
    sock = re.search(r"SPD_SOCKET=(\S+)", env)
    vols = [a for i, a in runtime["ins"] if i == "VOLUME"]
    check(sock and vols and os.path.dirname(sock.group(1)) in vols, "the socket is not in the image's VOLUME")
    print(f"Containerfile: CUDA {cuda} devel -> base, NCCL in both, USER {users[0]}, socket {sock.group(1)}")
    return cuda


# ---------------------------------------------------------------- the manifests

def test_manifests(cuda):
    docs = [d for d in yaml.safe_load_all(open(os.path.join(SRC, "deploy", "k8s", "spd.yaml"))) if d]
    docs += [d for d in yaml.safe_load_all(open(os.path.join(SRC, "deploy", "k8s", "spd-servicemonitor.yaml"))) if d]
    kinds = {d["kind"]: d for d in docs}
    for k in ("Namespace", "ConfigMap", "DaemonSet", "Service", "ServiceMonitor"):
        check(k in kinds, f"no {k}")
    ds = kinds["DaemonSet"]
    spec = ds["spec"]
    pod = spec["template"]["spec"]
    c = pod["containers"][0]

    check(spec["updateStrategy"]["type"] == "OnDelete", "updateStrategy is not OnDelete: a rollout would end jobs")
    check(pod.get("priorityClassName") == "system-node-critical", "priorityClassName is not system-node-critical")
    check(pod.get("nodeSelector"), "no nodeSelector: spd would land on nodes without GPUs")
    check(any(t.get("key") == "nvidia.com/gpu" and t.get("effect") == "NoSchedule" for t in pod.get("tolerations", [])),
          "no toleration of GPU nodes' nvidia.com/gpu taint")

    conf = kinds["ConfigMap"]["data"]["spd.conf"]
    opts = dict(line.split(None, 1) for line in conf.splitlines() if line.strip() and not line.lstrip().startswith("#"))
    metrics_port = int(opts["metrics_listen"].rsplit(":", 1)[1])
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    check(ports.get("metrics") == metrics_port, f"the metrics port {ports.get('metrics')} is not metrics_listen's")
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        p = c.get(probe)
        check(p and "exec" not in p, f"{probe}: missing, or a command (spctl takes a session slot)")
        get = p["httpGet"]
        port = ports.get(get["port"], get["port"])
        check(get["path"] == "/healthz" and port == metrics_port, f"{probe}: not GET /healthz on {metrics_port}")

    sc = c["securityContext"]
    caps = sc["capabilities"]
    check(caps.get("drop") == ["ALL"], "capabilities are not dropped (drop: ALL)")
    check(set(caps.get("add", [])) <= {"SYS_PTRACE", "IPC_LOCK", "CHOWN"}, f"capabilities added: {caps.get('add')}")
    check("IPC_LOCK" in caps.get("add", []), "no IPC_LOCK: memory for RDMA and CUDA cannot be pinned")
    check(sc.get("allowPrivilegeEscalation") is False, "allowPrivilegeEscalation is not false")
    check(sc.get("readOnlyRootFilesystem") is True, "the root file system is writable")
    seccomp = (sc.get("seccompProfile") or pod.get("securityContext", {}).get("seccompProfile") or {}).get("type")
    check(seccomp in ("RuntimeDefault", "Localhost"), f"seccomp profile {seccomp}")

    image = c["image"]
    check(not image.endswith(":latest") and (":" in image.rsplit("/", 1)[-1] or "@sha256:" in image),
          f"the image {image} is not pinned")
    cmake = open(os.path.join(SRC, "CMakeLists.txt")).read()
    version = re.search(r"project\(spd VERSION (\S+)", cmake).group(1)
    tag = image.rsplit(":", 1)[1]
    check(tag == f"{version}-cuda{cuda}", f"the image tag {tag} is not this release's ({version}) with CUDA {cuda}")

    env = {e["name"]: e.get("value") for e in c.get("env", [])}
    check(pod.get("runtimeClassName") == "nvidia" or env.get("NVIDIA_VISIBLE_DEVICES") == "all",
          "spd gets no GPUs")
    limits = c["resources"].get("limits", {})
    check("nvidia.com/gpu" not in limits, "spd claims GPUs, which the trainers need")
    check(any(k.startswith("rdma/") for k in limits), "no RDMA device resource")

    ann = spec["template"]["metadata"].get("annotations", {})
    check(ann.get("prometheus.io/scrape") == "true" and int(ann.get("prometheus.io/port", 0)) == metrics_port,
          f"scrape annotations {ann}")
    labels = spec["template"]["metadata"]["labels"]
    svc = kinds["Service"]
    check(svc["spec"].get("clusterIP") == "None", "the Service is not headless")
    check(all(labels.get(k) == v for k, v in svc["spec"]["selector"].items()), "the Service does not select spd's pods")
    sm = kinds["ServiceMonitor"]
    check(all(svc["metadata"]["labels"].get(k) == v for k, v in sm["spec"]["selector"]["matchLabels"].items()),
          "the ServiceMonitor does not select the Service")
    svc_ports = {p["name"] for p in svc["spec"]["ports"]}
    check(all(e["port"] in svc_ports and e.get("path", "/metrics") == "/metrics" for e in sm["spec"]["endpoints"]),
          "the ServiceMonitor scrapes a port the Service lacks")
    check(sm["metadata"]["namespace"] == svc["metadata"]["namespace"] == ds["metadata"]["namespace"],
          "the objects are in different namespaces")

    with tempfile.NamedTemporaryFile("w", suffix=".conf") as f:
        f.write(conf)
        f.flush()
        p = subprocess.run([SPD, "--config", f.name, "--check-config"], capture_output=True, text=True,
                           env={"PATH": os.environ.get("PATH", "")})
        check(p.returncode == 0, f"spd --check-config refuses the ConfigMap's configuration: {p.stderr}")
    print(f"DaemonSet: GPU nodes, system-node-critical, OnDelete, /healthz probes on {metrics_port}, "
          f"drop ALL + {caps['add']}, seccomp {seccomp}, image {image}; Service and ServiceMonitor find it")


if __name__ == "__main__":
    cuda = test_containerfile()
    test_manifests(cuda)
    print("manifests: ok")
