#!/usr/bin/env python3
"""What an operator relies on, against a real spd and spctl:

  - configuration errors: every disagreement between options is named, by
    --check-config, --dump-config and at start, and each exits 78 (EX_CONFIG,
    which the unit does not restart); a good configuration checks 0;
  - SIGHUP reads the configuration again: the live options change (spctl
    config shows it, debug lines appear), the others are named as waiting for
    a restart, and a bad file is refused whole;
  - log_format json: every line is one JSON object; journald priority prefixes
    exactly when stderr is the stream JOURNAL_STREAM names;
  - GET /healthz: 200 while the progress thread goes round, also when every
    session slot is taken; 503 once it is stopped (ptrace, this thread alone);
  - the socket's folder: one spd did not create keeps its mode; one others
    may write to is refused.

Usage: test_operations.py SPD SPCTL
"""
import atexit
import ctypes
import errno
import json
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

SPD, SPCTL = sys.argv[1], sys.argv[2]
EX_CONFIG = 78


def run(args, env=None, timeout=20):
    """Runs spd or spctl to the end; (exit status, stdout, stderr)."""
    p = subprocess.run(args, capture_output=True, text=True, errors="replace", timeout=timeout,
                       env=dict(os.environ, NOTIFY_SOCKET="", **(env or {})))
    return p.returncode, p.stdout, p.stderr


def wait_for(what, cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


_started = []


@atexit.register
def _kill_leftovers():
    """A test that failed midway leaves its spd: not past the test."""
    for proc in _started:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


class Daemon:
    """spd in a private folder, with `sets` as --set options and a config file
    when conf is given; stderr to a file of its own."""

    def __init__(self, d, sets=(), conf=None, env=None, sock=None):
        self.dir = d
        self.sock = sock or os.path.join(d, "run", "spd.sock")
        self.log = os.path.join(d, "spd.log")
        self.stderr_path = os.path.join(d, "stderr")
        self.conf = None
        args = [SPD, "--set", f"socket={self.sock}"]
        if conf is not None:
            self.conf = os.path.join(d, "spd.conf")
            with open(self.conf, "w") as f:
                f.write(conf)
            args += ["--config", self.conf]
        for s in sets:
            args += ["--set", s]
        self.stderr = open(self.stderr_path, "w")
        # Not the test's stdout: ctest would wait for a leftover spd to close it.
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=self.stderr, stdin=subprocess.DEVNULL,
                                     env=dict(os.environ, NOTIFY_SOCKET="", **(env or {})))
        _started.append(self.proc)
        try:
            wait_for("spd's socket", lambda: self.spctl("status")[0] == 0 or self.proc.poll() is not None)
            assert self.proc.poll() is None, f"spd exited {self.proc.returncode}: {self.read_stderr()}"
        except BaseException:
            self.proc.kill()
            self.proc.wait()
            raise

    def spctl(self, *args):
        return run([SPCTL, "--socket", self.sock, *args])

    def config(self, name):
        rc, out, err = self.spctl("--json", "config", "get", name)
        assert rc == 0, err
        return json.loads(out)

    def status(self):
        rc, out, err = self.spctl("--json", "status")
        assert rc == 0, err
        return json.loads(out)

    def read_log(self):
        with open(self.log) as f:
            return f.read()

    def read_stderr(self):
        with open(self.stderr_path) as f:
            return f.read()

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(timeout=15)
        self.stderr.close()
        assert rc == 0, f"spd exited {rc} on SIGTERM"


def fresh_dir():
    return tempfile.mkdtemp(prefix="spd-ops-")


# ---------------------------------------------------------------- configuration errors

BAD = ("peer_listen 127.0.0.1:0\n"
       "reply_pause_bytes 8M\n"
       "max_reply_bytes 4M\n")


def test_config_errors():
    d = fresh_dir()
    try:
        conf = os.path.join(d, "spd.conf")
        with open(conf, "w") as f:
            f.write(BAD)
        sock = os.path.join(d, "run", "spd.sock")
        for mode in ("--check-config", "--dump-config", None):
            args = [SPD, "--config", conf, "--set", f"socket={sock}"] + ([mode] if mode else [])
            rc, out, err = run(args)
            what = mode or "a start"
            assert rc == EX_CONFIG, f"{what}: exit {rc}, wanted {EX_CONFIG}; stderr: {err}"
            # Both disagreements, each naming its options, in one run.
            assert re.search(r"peer_listen and peers need cluster_secret_file", err), f"{what}: {err}"
            assert re.search(r"reply_pause_bytes \(8M\) is above max_reply_bytes \(4M\)", err), f"{what}: {err}"
            if mode == "--dump-config":
                assert "\nmax_reply_bytes 4M\n" in out, "--dump-config still prints what it resolved"
        assert not os.path.exists(os.path.dirname(sock)), "a start with a bad configuration created the socket's folder"

        # An option the file does not know, and a bad value from the environment: 78, naming them.
        with open(conf, "w") as f:
            f.write("op_timeout_ms 100\nno_such_option 1\n")
        rc, _, err = run([SPD, "--config", conf, "--check-config"])
        assert rc == EX_CONFIG and f"{conf}:2: unknown option 'no_such_option'" in err, (rc, err)
        rc, _, err = run([SPD, "--check-config"], env={"SPD_LOG_FORMAT": "xml"})
        assert rc == EX_CONFIG and "SPD_LOG_FORMAT: log_format: 'xml' is not text or json" in err, (rc, err)
        # What the options name on this node: a group that does not exist.
        rc, _, err = run([SPD, "--check-config", "--set", "allow_group=no-such-group-here"])
        assert rc == EX_CONFIG and "allow_group: no group 'no-such-group-here'" in err, (rc, err)
        # A bad argument is not a configuration error.
        rc, _, err = run([SPD, "--no-such-flag"])
        assert rc == 2 and "usage" in err.lower(), (rc, err)

        # Good: 0, and it says so; --dump-config too.
        with open(conf, "w") as f:
            f.write("peer_listen 127.0.0.1:0\nreply_pause_bytes 2M\nmax_reply_bytes 4M\n"
                    f"cluster_secret_file {d}/secret\n")
        rc, out, err = run([SPD, "--config", conf, "--check-config"])
        assert rc == 0 and f"configuration is good: {conf}" in out, (rc, out, err)
        rc, out, err = run([SPD, "--config", conf, "--dump-config"])
        assert rc == 0 and err == "", (rc, err)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    print("config errors: 78 naming the options, at start, --check-config and --dump-config")


# ---------------------------------------------------------------- SIGHUP

def test_sighup_reload():
    d = fresh_dir()
    try:
        sp = Daemon(d, conf=f"log_file {d}/spd.log\nlog_level info\nop_timeout_ms 60000\nnode_name first\n")
        assert sp.config("log_level")["value"] == "info"
        assert sp.config("op_timeout_ms")["value"] == "60000"
        sp.spctl("status")
        assert " debug " not in sp.read_log()

        with open(sp.conf, "w") as f:
            f.write(f"log_file {d}/spd.log\nlog_level debug\nop_timeout_ms 1234\nnode_name second\n")
        sp.proc.send_signal(signal.SIGHUP)
        wait_for("the new log level", lambda: sp.config("log_level")["value"] == "debug")
        c = sp.config("op_timeout_ms")
        assert c["value"] == "1234" and c["source"] == "file", c
        # node_name changes at a restart only: kept, and the log says so.
        assert sp.config("node_name")["value"] == "first"
        assert sp.status()["node"] == "first"
        log = wait_for("the reload's line", lambda: "SIGHUP: configuration read again" in sp.read_log() and
                       sp.read_log())
        assert re.search(r"SIGHUP: configuration read again: 2 options changed; these differ but change only at "
                         r"a restart: node_name", log), log
        # The level is the logger's now: a control session logs at debug.
        sp.spctl("status")
        wait_for("a debug line", lambda: " debug " in sp.read_log())

        # A file whose options disagree is refused whole: nothing changes.
        with open(sp.conf, "w") as f:
            f.write(f"log_file {d}/spd.log\nlog_level error\npeers 127.0.0.1:9\n")
        sp.proc.send_signal(signal.SIGHUP)
        wait_for("the refusal", lambda: "the running one is kept" in sp.read_log())
        assert "peer_listen and peers need cluster_secret_file" in sp.read_log()
        assert sp.config("log_level")["value"] == "debug"
        assert sp.config("peers")["value"] == ""
        sp.stop()
    finally:
        shutil.rmtree(d, ignore_errors=True)
    print("SIGHUP: live options change (log level, op_timeout_ms), node_name waits for a restart, a bad file is kept out")


# ---------------------------------------------------------------- log formats

def test_json_log():
    d = fresh_dir()
    try:
        # A node name with a quote, a backslash, a byte that is not UTF-8 and one
        # character that is: the log escapes the first two and replaces the third.
        sp = Daemon(d, sets=[f"log_file={d}/spd.log", "log_format=json", "log_level=debug",
                             b'node_name=n"1\\x\xff\xc3\xa9'])
        sp.spctl("status")
        sp.stop()
        with open(sp.log, encoding="utf-8") as f:   # strict: every line is UTF-8
            lines = f.read().splitlines()
        assert len(lines) > 5, lines
        recs = [json.loads(line) for line in lines]
        for r in recs:
            assert set(r) == {"time", "host", "pid", "tid", "level", "subsys", "msg"}, r
            assert r["level"] in ("error", "warn", "info", "debug", "trace"), r
            assert r["pid"] == sp.proc.pid
            assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z", r["time"]), r
        assert any('starting on node n"1\\x\ufffd\u00e9 ' in r["msg"] for r in recs), [r["msg"] for r in recs[:3]]
        assert any(r["level"] == "debug" for r in recs)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    print(f"log_format json: {len(lines)} lines, each one JSON object with the escaped message")


def test_journal_prefixes():
    d = fresh_dir()
    try:
        # JOURNAL_STREAM naming another stream (stderr was redirected since): plain lines.
        sp = Daemon(d, sets=["log_level=debug"], env={"JOURNAL_STREAM": "0:0"})
        sp.stop()
        plain = sp.read_stderr().splitlines()
        assert plain and not any(line.startswith("<") for line in plain), plain[:3]

        # stderr is a file, which JOURNAL_STREAM names as systemd names its stream.
        d2 = os.path.join(d, "two")
        os.mkdir(d2)
        stderr_path = os.path.join(d2, "stderr")
        open(stderr_path, "w").close()
        st = os.stat(stderr_path)
        sp = Daemon(d2, sets=["log_level=debug"], env={"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"})
        sp.stop()
        lines = sp.read_stderr().splitlines()
        prio = {"error": "<3>", "warn": "<4>", "info": "<6>", "debug": "<7>"}
        seen = set()
        for line in lines:
            m = re.match(r"(<\d>)\S+ \S+ (\w+)\s", line)
            assert m, f"no priority prefix: {line}"
            assert m.group(1) == prio[m.group(2)], line
            seen.add(m.group(2))
        assert {"info", "debug"} <= seen, seen

        # A configuration that cannot run: an error the journal files as one,
        # whatever log_subsys leaves out.
        with open(stderr_path, "w") as err:
            rc = subprocess.run([SPD, "--set", "peers=127.0.0.1:9", "--set", "log_subsys=core"], stderr=err,
                                env=dict(os.environ, NOTIFY_SOCKET="", JOURNAL_STREAM=f"{st.st_dev}:{st.st_ino}"),
                                timeout=20).returncode
        with open(stderr_path) as err:
            bad = err.read()
        assert rc == EX_CONFIG and re.match(r"<3>\S+ \S+ error cfg +configuration: peer_listen and peers need "
                                            r"cluster_secret_file.*; spd does not start\n$", bad), (rc, bad)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    print(f"journald: priority prefixes on {len(lines)} lines when stderr is JOURNAL_STREAM, none otherwise; "
          "a configuration that cannot run is an error (<3>)")


# ---------------------------------------------------------------- /healthz

libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
libc.ptrace.restype = ctypes.c_long
PTRACE_DETACH, PTRACE_SEIZE, PTRACE_INTERRUPT = 17, 0x4206, 0x4207


def healthz(addr):
    try:
        with urllib.request.urlopen(f"http://{addr}/healthz", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def progress_tid(pid):
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/comm") as f:
            if f.read().strip() == "spd-progress":
                return int(tid)
    raise AssertionError("no spd-progress thread")


def test_healthz():
    d = fresh_dir()
    try:
        sp = Daemon(d, sets=[f"log_file={d}/spd.log", "metrics_listen=127.0.0.1:0", "max_clients=2",
                             "session_idle_ms=60000", "progress_sleep_ms=1000"])
        addr = sp.status()["metrics_listen"]
        code, body = healthz(addr)
        assert code == 200 and body.startswith("ok: the progress thread went round"), (code, body)

        # Every session slot taken by connections that never say hello: spctl
        # is refused, the probe is not.
        held = []
        for _ in range(2):
            s = socket.socket(socket.AF_UNIX)
            s.connect(sp.sock)
            held.append(s)
        wait_for("spctl refused", lambda: sp.spctl("status")[0] != 0)
        code, body = healthz(addr)
        assert code == 200, (code, body)

        # The progress thread stopped, the rest of spd running: 503 once it
        # has not gone round for 5 s, 200 again when it goes on.
        tid = progress_tid(sp.proc.pid)
        if libc.ptrace(PTRACE_SEIZE, tid, None, None) != 0:
            err = ctypes.get_errno()
            if err in (errno.EPERM, errno.EACCES):
                print(f"healthz: skipping the stalled-thread case: ptrace refused ({os.strerror(err)})")
                tid = None
            else:
                raise OSError(err, "PTRACE_SEIZE")
        if tid is not None:
            try:
                assert libc.ptrace(PTRACE_INTERRUPT, tid, None, None) == 0
                os.waitpid(tid, 0x40000000)   # __WALL: it is a thread
                t0 = time.monotonic()
                code, body = wait_for("503", lambda: (lambda r: r if r[0] == 503 else None)(healthz(addr)), 10)
                waited = time.monotonic() - t0
                assert body.startswith("stale: the progress thread has not gone round for"), body
                assert waited > 3.5, f"503 after {waited:.1f} s, before the 5 s it allows"
            finally:
                libc.ptrace(PTRACE_DETACH, tid, None, None)
            wait_for("200 again", lambda: healthz(addr)[0] == 200, 5)
            print(f"healthz: 503 {waited:.1f} s after the progress thread stopped, 200 once it went on")
        for s in held:
            s.close()
        wait_for("a free slot", lambda: sp.spctl("status")[0] == 0)
        sp.stop()
    finally:
        shutil.rmtree(d, ignore_errors=True)
    print("healthz: 200 with every session slot taken")


# ---------------------------------------------------------------- the socket's folder

def test_socket_folder():
    d = fresh_dir()
    try:
        # Made by someone else (systemd's RuntimeDirectory, a hostPath): its mode stays.
        run_dir = os.path.join(d, "shared")
        os.mkdir(run_dir)
        os.chmod(run_dir, 0o755)
        sp = Daemon(d, sock=os.path.join(run_dir, "spd.sock"), sets=[f"log_file={d}/spd.log"])
        assert stat.S_IMODE(os.stat(run_dir).st_mode) == 0o755, oct(os.stat(run_dir).st_mode)
        assert stat.S_IMODE(os.stat(sp.sock).st_mode) == 0o600
        sp.stop()
        assert stat.S_IMODE(os.stat(run_dir).st_mode) == 0o755

        # Writable by others, who could swap the socket: refused, mode untouched.
        os.chmod(run_dir, 0o777)
        rc, _, err = run([SPD, "--set", f"socket={run_dir}/spd.sock"])
        assert rc == 1 and "is writable by other users (mode 0777)" in err, (rc, err)
        assert stat.S_IMODE(os.stat(run_dir).st_mode) == 0o777

        # Created by spd: its own mode.
        sp = Daemon(d, sets=[f"log_file={d}/spd.log"])
        assert stat.S_IMODE(os.stat(os.path.dirname(sp.sock)).st_mode) == 0o700
        sp.stop()
    finally:
        shutil.rmtree(d, ignore_errors=True)
    print("socket folder: one spd did not create keeps 0755; a 0777 one is refused and left 0777")


if __name__ == "__main__":
    for name, fn in list(globals().items()):
        if name.startswith("test_") and callable(fn):
            fn()
    print("operations: ok")
