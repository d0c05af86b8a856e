"""deploy/grafana/spd.json against real daemons' /metrics.

Two spd, linked as peers, one of them running a job of two rank processes
that all-reduce, then fail one all-reduce (they disagree on its count), and
stay joined while /metrics is read. Then for every query of the dashboard (its panels'
and its variables'):
  - every metric it names is a family of the exposition, of the type the query
    needs: rate() of a counter (or of a histogram's _sum, _count, _bucket),
    histogram_quantile() of a histogram's buckets, a gauge read as it is;
  - the metric has samples, and each carries the labels the query sums by or
    its legend names (`instance` excepted: Prometheus adds it when it scrapes).

Usage: python3 test_grafana.py SPD LIBSPCLIENT DASHBOARD
"""
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

SPD, LIB, DASHBOARD = sys.argv[1:4]
# A sanitizer build of the library needs its runtime loaded first (as tests/python/run.sh
# does); ThreadSanitizer's cannot be loaded into python3 at all.
runtime = subprocess.run(["ldd", LIB], capture_output=True, text=True).stdout
if "libtsan" in runtime:
    print("skipped: libspclient is built with ThreadSanitizer, which python3 cannot load", file=sys.stderr)
    sys.exit(77)
asan = re.search(r"(/\S*libasan\S*)", runtime)
if asan and asan.group(1) not in os.environ.get("LD_PRELOAD", ""):
    os.execve(sys.executable, [sys.executable] + sys.argv,
              dict(os.environ, LD_PRELOAD=asan.group(1), ASAN_OPTIONS="detect_leaks=0"))
os.environ["SPCLIENT_LIB"] = LIB
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "client", "python"))
try:
    import spclient  # noqa: E402
except ImportError as e:
    print(f"skipped: the Python binding does not load ({e}; apt-get install python3-numpy)", file=sys.stderr)
    sys.exit(77)

tmp = tempfile.mkdtemp(prefix="spd-grafana-")
daemons = []


def start(name, *sets):
    """spd as node `name`; returns its socket once it answers."""
    sock = os.path.join(tmp, name, "spd.sock")
    args = [SPD, "--set", f"socket={sock}", "--set", f"node_name={name}", "--set", f"log_file={tmp}/{name}.log"]
    for s in sets:
        args += ["--set", s]
    proc = subprocess.Popen(args, env=dict(os.environ, NOTIFY_SOCKET=""))
    daemons.append(proc)
    deadline = time.time() + 10
    while True:
        try:
            spclient.attach(socket=sock).close()
            return sock
        except spclient.SpdError:
            if time.time() > deadline or proc.poll() is not None:
                sys.exit(f"FAIL: spd {name} did not start:\n" + open(f"{tmp}/{name}.log").read())
            time.sleep(0.05)


def status(sock):
    h = spclient.attach(socket=sock)
    try:
        return h.query("status")[0]
    finally:
        h.close()


def rank(sock, job, r, ready, done):
    """A rank: all-reduces that add up, then one the ranks disagree on; stays
    joined until the parent has read the metrics."""
    h = spclient.attach(socket=sock)
    world = h.join(job, 2, r)
    x = h.empty(1024, dtype="float64")
    for _ in range(20):
        x[:] = r + 1.0
        h.allreduce(world, x)
        assert (x == 3.0).all(), x[:4]
    try:   # the ranks disagree on the count: spd fails the op on both
        h.allreduce(world, x[: 16 * (r + 1)])
        raise AssertionError("an all-reduce of 16 and 32 elements completed")
    except spclient.SpdError as e:
        assert "MISMATCH" in str(e), e
    os.write(ready, b"x")
    os.read(done, 1)
    h.close()


def scrape(addr):
    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=10) as r:
        return r.read().decode()


def parse(text):
    """{family: type} and {series name: [label sets]} of an exposition."""
    types, samples = {}, {}
    for line in text.splitlines():
        m = re.match(r"# TYPE (\S+) (\S+)$", line)
        if m:
            types[m.group(1)] = m.group(2)
        elif line and not line.startswith("#"):
            m = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? \S+$", line)
            assert m, f"not a sample line: {line!r}"
            labels = set(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="', m.group(2) or ""))
            samples.setdefault(m.group(1), []).append(labels)
    return types, samples


def family_of(name, types):
    for suffix in ("_bucket", "_sum", "_count"):
        base = name[: -len(suffix)]
        if name.endswith(suffix) and types.get(base) == "histogram":
            return base, suffix
    return name, ""


def queries(dash):
    """(where, expr, legend) of every query in the dashboard."""
    for p in dash["panels"]:
        for t in p.get("targets", []):
            yield p["title"], t["expr"], t.get("legendFormat", "")
    for v in dash["templating"]["list"]:
        if v["type"] == "query":
            q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
            yield f"variable {v['name']}", q, ""


def check(dash, types, samples):
    checked = set()
    for where, expr, legend in queries(dash):
        names = re.findall(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{", expr) + re.findall(r"label_values\((\w+)", expr)
        # Every spd_ and process_ name in the query is one of those: none is written bare.
        assert sorted(set(re.findall(r"\b(?:spd|process)_\w+", expr))) == sorted(set(names)), f"{where}: {expr}"
        assert names, f"{where}: no metric in {expr}"
        wanted = set()
        for by in re.findall(r"\bby \(([^)]*)\)", expr):
            wanted |= {l.strip() for l in by.split(",") if l.strip()}
        wanted |= set(re.findall(r"\{\{(\w+)\}\}", legend))
        wanted -= {"instance", "le"}
        for name in names:
            fam, suffix = family_of(name, types)
            assert fam in types, f"{where}: {name} is not in spd's /metrics"
            kind = types[fam]
            rated = re.search(r"rate\(\s*" + re.escape(name) + r"\{", expr) is not None
            if kind == "histogram":
                assert suffix, f"{where}: {name} is a histogram; query its _bucket, _sum or _count"
                assert rated, f"{where}: {name} is cumulative; take its rate()"
                if suffix == "_bucket":
                    assert "histogram_quantile(" in expr and re.search(r"by \([^)]*\ble\b", expr), \
                        f"{where}: buckets need histogram_quantile() over le"
            elif kind == "counter":
                assert rated, f"{where}: {name} is a counter; take its rate()"
            else:
                assert kind == "gauge" and not rated, f"{where}: {name} is a {kind}; read it as it is"
            assert samples.get(name), f"{where}: {name} has no sample in spd's /metrics"
            for labels in samples[name]:
                assert wanted <= labels, f"{where}: {name}{sorted(labels)} lacks {sorted(wanted - labels)}"
            checked.add(name)
    return checked


def main():
    secret = os.path.join(tmp, "secret")
    with open(os.open(secret, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
        f.write(secrets.token_hex(32))
    b = start("b", f"cluster_secret_file={secret}", "peer_listen=127.0.0.1:0", "peer_heartbeat_ms=50")
    a = start("a", f"cluster_secret_file={secret}", f"peers={status(b)['peer_listen']}", "peer_heartbeat_ms=50",
              "metrics_listen=127.0.0.1:0", "metrics_per_group=1")
    addr = status(a)["metrics_listen"]

    owner = spclient.attach(socket=a)
    job = owner.job_create()
    ready, done = os.pipe(), os.pipe()
    pids = []
    for r in range(2):
        pid = os.fork()
        if pid == 0:
            os.close(ready[0])
            os.close(done[1])
            code = 0
            try:
                rank(a, job, r, ready[1], done[0])
            except BaseException as e:
                print(f"rank {r}: {e!r}", file=sys.stderr)
                code = 1
            os._exit(code)
        pids.append(pid)
    os.close(ready[1])
    os.close(done[0])
    try:
        for _ in range(2):
            assert os.read(ready[0], 1) == b"x", "a rank died"
        deadline = time.time() + 10
        while 'spd_peers{state="up"} 1' not in (text := scrape(addr)):
            assert time.time() < deadline, "the peer link to b did not come up"
            time.sleep(0.05)
        types, samples = parse(text)
        checked = check(json.load(open(DASHBOARD)), types, samples)
    finally:
        os.close(done[1])   # the ranks' read returns: they leave
        codes = [os.waitpid(p, 0)[1] for p in pids]
        owner.close()
    assert codes == [0, 0], f"ranks exited {codes}"
    print(f"{len(checked)} metrics queried by the dashboard, each in spd's /metrics with its type and labels:")
    print(" ".join(sorted(checked)))
    unqueried = sorted(f for f in types if f not in {family_of(n, types)[0] for n in checked})
    if unqueried:
        print("exported but not on the dashboard:", " ".join(unqueried))


try:
    main()
finally:
    for p in daemons:
        p.send_signal(signal.SIGTERM)
    for p in daemons:
        p.wait(timeout=15)
    shutil.rmtree(tmp, ignore_errors=True)
print("grafana: ok")
