"""Shared by the Python tests: a real spd per test module and real rank processes.

SPD_BIN and SPCLIENT_LIB point at the build (ctest sets them; by default the
checkout's build/ is used). Ranks are forked processes, each attaching its own
handle, as trainer processes do.

With SP_PYTEST_SKIPPED_EXIT set (run.sh sets 77), a session in which every test
was skipped and none ran exits with that code, so ctest shows "skipped" rather
than counting the skips as passed.
"""
import contextlib
import faulthandler
import itertools
import os
import pickle
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback

import pytest

ROOT = os.path.normpath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "client", "python"))

import spclient  # noqa: E402


def spd_start(sock, log, env=None):
    """spd on socket `sock`, logging to `log`, `env` added to its environment;
    its Popen, once it answers. Another spd started on the socket of one that
    went takes over the clients of the one before."""
    binary = os.environ.get("SPD_BIN", os.path.join(ROOT, "build", "daemon", "spd"))
    proc = subprocess.Popen([binary, "--set", f"socket={sock}", "--set", f"log_file={log}",
                             "--set", "log_level=debug"], env=dict(os.environ, NOTIFY_SOCKET="", **(env or {})))
    deadline = time.time() + 10
    while True:
        try:
            spclient.attach(socket=sock).close()
            return proc
        except spclient.SpdError:
            if time.time() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError(f"spd did not start; log:\n{open(log).read() if os.path.exists(log) else ''}")
            time.sleep(0.05)


@contextlib.contextmanager
def spd_running(env=None):
    """spd in a private directory, `env` added to its environment; yields its
    socket path and stops it (cleanly, or the test fails) afterwards."""
    d = tempfile.mkdtemp(prefix="spd-py-")
    sock = os.path.join(d, "run", "spd.sock")
    proc = spd_start(sock, os.path.join(d, "spd.log"), env)
    try:
        yield sock
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            assert proc.wait(timeout=15) == 0, "spd did not exit cleanly on SIGTERM"
        finally:
            if proc.poll() is None:
                proc.kill()
            shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def spd():
    """Starts spd in a private directory; yields its socket path."""
    with spd_running() as sock:
        os.environ["SPC_SOCKET"] = sock
        yield sock


_outcomes = {"ran": 0, "skipped": 0, "why": []}


def _count(report):
    if report.skipped:
        _outcomes["skipped"] += 1
        why = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        if why not in _outcomes["why"]:
            _outcomes["why"].append(why)
    elif report.failed or getattr(report, "when", None) == "call":
        _outcomes["ran"] += 1


def pytest_runtest_logreport(report):
    _count(report)


def pytest_collectreport(report):
    if report.skipped or report.failed:
        _count(report)


def pytest_sessionfinish(session, exitstatus):
    code = os.environ.get("SP_PYTEST_SKIPPED_EXIT")
    if code and exitstatus in (0, 5) and _outcomes["skipped"] and not _outcomes["ran"]:
        # The line tools/run-tests lists under "Skipped (not passed)".
        for why in _outcomes["why"]:
            print(f"skipped: {why.removeprefix('Skipped: ')}", file=sys.stderr)
        session.exitstatus = int(code)


def _host(x):
    """x with every tensor in it copied to the host: a CUDA tensor unpickled
    here would start CUDA in this process, and the ranks it forks next could not."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return type(x)(*(_host(v) for v in x))
    if isinstance(x, (list, tuple)):
        return type(x)(_host(v) for v in x)
    if isinstance(x, dict):
        return {k: _host(v) for k, v in x.items()}
    return x




def _rank_timeout(timeout):
    """A test's bound on its ranks, lowered by SP_RANK_TIMEOUT (seconds) where a
    run must finish within a budget (the GPU machine's)."""
    cap = os.environ.get("SP_RANK_TIMEOUT")
    return min(timeout, float(cap)) if cap else timeout


def _read_by(fd, deadline):
    """What the child writes to fd until it closes it, or None if it has not by
    the deadline (time.monotonic())."""
    chunks = []
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return None
        b = os.read(fd, 1 << 16)
        if not b:
            return b"".join(chunks)
        chunks.append(b)


def in_child(fn, *args, timeout=600):
    """fn(*args) in a forked process, its result (on the host) returned. For work
    that would start CUDA in this process, which forks the ranks: a backward()
    does, even on CPU tensors (torch's autograd engine counts the GPUs). A
    child still running after `timeout` seconds (SP_RANK_TIMEOUT lowers it)
    fails the test with its Python stack, on the captured stderr."""
    timeout = _rank_timeout(timeout)
    rd, wr = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(rd)
        faulthandler.register(signal.SIGUSR1, all_threads=True)
        try:
            out = ("ok", _host(fn(*args)))
        except BaseException:
            out = ("error", traceback.format_exc())
        with os.fdopen(wr, "wb") as f:
            pickle.dump(out, f)
        os._exit(0)
    os.close(wr)
    data = _read_by(rd, time.monotonic() + timeout)
    os.close(rd)
    if data is None:
        os.kill(pid, signal.SIGUSR1)
        time.sleep(0.3)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail(f"the child running {getattr(fn, '__qualname__', fn)} still ran after {timeout:g} s (its "
                    "stack is in the captured stderr)")
    os.waitpid(pid, 0)
    kind, value = pickle.loads(data) if data else ("error", "the child died")
    if kind == "error":
        pytest.fail(value)
    return value


def _ops_pending():
    """spd's ops still open, one line each: where ranks that hang wait."""
    try:
        with spclient.attach() as h:
            return "\n".join("  " + " ".join(f"{k}={v}" for k, v in op.items()) for op in h.query("ops")) or "  none"
    except spclient.SpdError as e:
        return f"  (spd did not answer: {e})"


_jobs = itertools.count()


def run_ranks(n, fn, *args, timeout=60, attach=None, meanwhile=None):
    """Runs fn(h, world, rank, n, *args) in n forked rank processes of one job and
    returns their results by rank; attach: keyword arguments of the ranks'
    spclient.attach(); meanwhile: called here while the ranks run (what a test
    does to spd under them). The ranks join a job named for this run_ranks, as
    a launcher's ranks do: nobody creates it. A rank's exception fails the test
    with its traceback; a rank still running after `timeout` seconds fails it
    with its Python stack (faulthandler, on its stderr) and the ops spd still
    has open."""
    job = f"pytest-{os.getpid()}-{next(_jobs)}"
    pipes, pids = [], []
    for r in range(n):
        rd, wr = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(rd)
            faulthandler.register(signal.SIGUSR1, all_threads=True)
            code = 0
            try:
                h = spclient.attach(name=f"rank{r}", **(attach or {}))
                world = h.join_named(job, n, r)
                out = ("ok", _host(fn(h, world, r, n, *args)))
                h.close()
            except BaseException:
                out = ("error", traceback.format_exc())
                code = 1
            with os.fdopen(wr, "wb") as f:
                pickle.dump(out, f)
            os._exit(code)
        os.close(wr)
        pipes.append(rd)
        pids.append(pid)
    if meanwhile is not None:
        try:
            meanwhile()
        except BaseException:
            for rd, pid in zip(pipes, pids):
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                os.close(rd)
            raise
    timeout = _rank_timeout(timeout)
    deadline = time.monotonic() + timeout
    results, errors, hung = [], [], []
    for r, (rd, pid) in enumerate(zip(pipes, pids)):
        data = _read_by(rd, deadline)
        os.close(rd)
        if data is None:
            hung.append(r)
            results.append(None)
            continue
        status = os.waitpid(pid, 0)[1]
        kind, value = pickle.loads(data) if data else ("error", f"rank {r} died (status {status})")
        if kind == "error":
            errors.append(f"rank {r}:\n{value}")
        results.append(value)
    if hung:
        pending = _ops_pending()
        for r in hung:
            os.kill(pids[r], signal.SIGUSR1)   # its stack, to the captured stderr
            time.sleep(0.2)                    # one after the other
        for r in hung:
            os.kill(pids[r], signal.SIGKILL)
            os.waitpid(pids[r], 0)
        errors.append(f"ranks {hung} still ran after {timeout:g} s (their stacks are in the captured stderr); "
                      f"spd's open ops:\n{pending}")
    if errors:
        pytest.fail("\n".join(errors))
    return results
