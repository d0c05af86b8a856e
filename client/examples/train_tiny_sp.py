#!/usr/bin/env python3
"""Trains a tiny decoder-only transformer with and without sequence parallelism
through spd, and prints how far each SP configuration drifts from SP = 1.

    python3 client/examples/train_tiny_sp.py --spd build/daemon/spd     # starts a private spd
    python3 client/examples/train_tiny_sp.py                            # uses $SPC_SOCKET's spd
    python3 client/examples/train_tiny_sp.py --spd build/daemon/spd --nodes 2   # ranks over 2 daemons
    python3 client/examples/train_tiny_sp.py --spd build/daemon/spd --device cuda   # on GPUs
    python3 client/examples/train_tiny_sp.py --spd build/daemon/spd --restart-at 5  # spd killed mid-training
    python3 client/examples/train_tiny_sp.py --spd build/daemon/spd --nodes 2 --restart-at 5  # one of two

The model: token embedding, RoPE, causal grouped-query attention (6 query heads,
2 KV heads), SwiGLU MLP, RMSNorm, 2 layers. The data: packed documents (SFT) and
chosen/rejected pairs (DPO) of a small synthetic language, padded to a multiple
of 2 x sp, position ids restarting at every document.

SP = 1 is one plain torch process, no spd. Every other configuration forks one
process per rank; each attaches to spd, joins the job, builds its mesh, feeds
the model only its own tokens (zigzag over the ring, contiguous pieces inside a
Ulysses group) and does attention through spclient.attention. The SFT loss is
the token mean over ranks (spclient.torch.token_mean_loss), the DPO loss sums
each sequence's log-probs over ranks before the sigmoid (spclient.torch.dpo_loss);
both all-reduce their gradient in backward, so the parameter gradients,
averaged over the SP group as data parallelism averages them, are those of
SP = 1. All configurations see the same batches and start from the same weights.

With --device cuda the model, its activations and every op's tensors live on
the GPU (rank r on GPU r mod the GPU count; one GPU may hold every rank): spd
moves device memory in the order of each rank's torch stream, and SP = 1 runs
on the GPU too (in a process of its own, so that this one never initialises
CUDA before it forks the ranks).

With --restart-at STEP each configuration trains twice in fp64, the second time
with spd SIGKILLed after SFT step STEP and another started on its socket, which
takes the running ranks over: every loss and gradient must be the uninterrupted
run's, bit for bit. With --nodes, the last node's spd is the one killed; the
others keep the job (peer_restart_grace_ms, 20 s here) until it claims it back.

Printed per configuration: the largest |loss - loss(SP=1)| over the steps, the
largest |grad - grad(SP=1)| over every parameter and step, and, at the initial
weights (learning rate 0), the largest difference of the per-token log-probs
and whether they are bit for bit those of SP = 1.
"""
import argparse
import multiprocessing
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

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import spclient  # noqa: E402
import spclient.attention as spa  # noqa: E402
import spclient.torch as spt  # noqa: E402

# Daemons the ranks are spread over (--nodes): their sockets, rank r on
# SOCKETS[r * len(SOCKETS) // size]. Empty: every rank on $SPC_SOCKET's spd.
SOCKETS = []
# With private daemons (start_spd): the function that SIGKILLs one (the last
# one started, the only one with several) and starts another on its socket,
# which takes its running ranks over (and, with several, claims their job
# back from the others: they wait peer_restart_grace_ms for it).
RESTART = []

# name, ulysses, ring
CONFIGS = [
    ("SP=2 Ulysses", 2, 1),
    ("SP=4 Ulysses 2 x Ring 2", 2, 2),
    ("SP=3 Ring", 1, 3),
    ("SP=4 Ulysses (dummy heads, KV replicated)", 4, 1),
]


class Cfg:
    vocab, dim, heads, kv_heads, layers, ffn = 64, 48, 6, 2, 2, 96
    sft_len, sft_rows = 45, 2          # tokens per packed row before padding
    prompt, response, pairs = 8, 12, 2
    beta = 0.1

    def __init__(self, dtype=torch.float64, steps=20, lr_sft=3e-3, lr_dpo=1e-3, device="cpu"):
        self.dtype, self.steps, self.lr_sft, self.lr_dpo = dtype, steps, lr_sft, lr_dpo
        self.device = device
        self.restart_at, self.say_fd = None, None   # restart_check: the SFT step after which spd is killed

    def device_of(self, rank=0):
        """The torch device of rank `rank` (SP = 1 is rank 0)."""
        if self.device == "cuda":
            return torch.device("cuda", rank % torch.cuda.device_count())
        return torch.device(self.device)

    @property
    def head_dim(self):
        return self.dim // self.heads


# ---------------------------------------------------------------- the model


class RMSNorm(torch.nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


def rope(x, positions):
    """Rotary embedding of x [B, S, H, D] at the tokens' own positions [B, S]."""
    d = x.shape[-1] // 2
    freq = 10000.0 ** (-torch.arange(d, dtype=x.dtype, device=x.device) / d)
    ang = positions.to(x.dtype)[..., None] * freq                   # [B, S, d]
    cos, sin = ang.cos()[:, :, None], ang.sin()[:, :, None]
    a, b = x[..., :d], x[..., d:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


class Block(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        self.n1, self.n2 = RMSNorm(c.dim), RMSNorm(c.dim)
        self.wq = torch.nn.Linear(c.dim, c.heads * c.head_dim, bias=False)
        self.wk = torch.nn.Linear(c.dim, c.kv_heads * c.head_dim, bias=False)
        self.wv = torch.nn.Linear(c.dim, c.kv_heads * c.head_dim, bias=False)
        self.wo = torch.nn.Linear(c.heads * c.head_dim, c.dim, bias=False)
        self.gate = torch.nn.Linear(c.dim, c.ffn, bias=False)
        self.up = torch.nn.Linear(c.dim, c.ffn, bias=False)
        self.down = torch.nn.Linear(c.ffn, c.dim, bias=False)

    def forward(self, x, positions, attend):
        B, S, _ = x.shape
        c = self.c
        y = self.n1(x)
        q = rope(self.wq(y).view(B, S, c.heads, c.head_dim), positions)
        k = rope(self.wk(y).view(B, S, c.kv_heads, c.head_dim), positions)
        v = self.wv(y).view(B, S, c.kv_heads, c.head_dim)
        x = x + self.wo(attend(q, k, v).reshape(B, S, -1))
        y = self.n2(x)
        return x + self.down(F.silu(self.gate(y)) * self.up(y))


class TinyLM(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed = torch.nn.Embedding(c.vocab, c.dim)
        self.blocks = torch.nn.ModuleList(Block(c) for _ in range(c.layers))
        self.norm = RMSNorm(c.dim)
        self.head = torch.nn.Linear(c.dim, c.vocab, bias=False)

    def forward(self, tokens, positions, attend):
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x, positions, attend)
        return self.head(self.norm(x))


def new_model(c, device="cpu"):
    """The same weights on every device: made on the host, then moved."""
    torch.manual_seed(1234)
    return TinyLM(c).to(c.dtype).to(device)


def token_logprobs(logits, labels):
    """log p(label) per token; 0 where the label is -100."""
    lp = torch.log_softmax(logits, dim=-1)
    safe = labels.clamp(min=0)
    return lp.gather(-1, safe[..., None])[..., 0] * (labels >= 0).to(lp.dtype)


# ---------------------------------------------------------------- the data


def _next_token(t, g, c):
    """The synthetic language: mostly t -> 5t + 3 (mod vocab), sometimes noise."""
    if torch.rand((), generator=g) < 0.15:
        return int(torch.randint(c.vocab, (), generator=g))
    return (5 * t + 3) % c.vocab


def sft_batch(c, step):
    """Rows of packed documents: tokens, position ids (0 at every document start)
    and next-token labels inside each document (-100 at a document's end)."""
    g = torch.Generator().manual_seed(100 + step)
    toks, pos, labels = [], [], []
    for _ in range(c.sft_rows):
        t, p, lab = [], [], []
        while len(t) < c.sft_len:
            n = min(int(torch.randint(4, 19, (), generator=g)), c.sft_len - len(t))
            doc = [int(torch.randint(c.vocab, (), generator=g))]
            for _ in range(n - 1):
                doc.append(_next_token(doc[-1], g, c))
            t += doc
            p += list(range(n))
            lab += doc[1:] + [-100]
        toks.append(t), pos.append(p), labels.append(lab)
    return torch.tensor(toks), torch.tensor(pos), torch.tensor(labels)


def dpo_batch(c, step):
    """Rows chosen_0, rejected_0, chosen_1, ...: a prompt, then a response that
    follows the language (chosen) or is noise (rejected). Labels only on the
    response: a sequence's log-prob is the sum of its response tokens'."""
    g = torch.Generator().manual_seed(900 + step)
    toks, labels = [], []
    for _ in range(c.pairs):
        prompt = [int(torch.randint(c.vocab, (), generator=g)) for _ in range(c.prompt)]
        good = [_next_token(prompt[-1], g, c)]
        for _ in range(c.response - 1):
            good.append(_next_token(good[-1], g, c))
        bad = [int(torch.randint(c.vocab, (), generator=g)) for _ in range(c.response)]
        for resp in (good, bad):
            t = prompt + resp
            toks.append(t)
            labels.append([-100] * (c.prompt - 1) + resp + [-100])
    n = c.prompt + c.response
    return torch.tensor(toks), torch.arange(n).repeat(len(toks), 1), torch.tensor(labels)


def pad_batch(batch, sp):
    """Pads to a multiple of 2 x sp: pad tokens form a document of their own
    (positions from 0) and carry no label, so no real token sees them."""
    tokens, pos, labels = batch
    S = tokens.shape[1]
    Sp = S + (-S) % (2 * sp)
    tail = torch.arange(Sp - S).repeat(tokens.shape[0], 1)
    return (spt.pad_to_multiple(tokens, 2 * sp), torch.cat([pos, tail], dim=1),
            spt.pad_to_multiple(labels, 2 * sp, value=-100))


def document_mask(pos):
    """[B, S, S]: causal inside each document, written out with loops over the
    documents so that it shares nothing with the SP layout code."""
    B, S = pos.shape
    m = torch.zeros(B, S, S, dtype=torch.bool)
    for b in range(B):
        start = 0
        for i in range(1, S + 1):
            if i == S or pos[b, i] != pos[b, i - 1] + 1:
                m[b, start:i, start:i] = torch.ones(i - start, i - start, dtype=torch.bool).tril()
                start = i
    return m


# ---------------------------------------------------------------- SP = 1


def train_single(c):
    """The reference: one process, whole sequences, no spd. Returns per task the
    losses, flat gradients per step and the step-0 per-token log-probs."""
    torch.set_num_threads(1)
    dev = c.device_of(0)
    out = {}
    for task in ("sft", "dpo"):
        model = new_model(c, dev)
        ref = new_model(c, dev) if task == "dpo" else None
        opt = torch.optim.AdamW(model.parameters(), lr=c.lr_sft if task == "sft" else c.lr_dpo, weight_decay=0.0)
        losses, grads, lp0 = [], [], None
        for step in range(c.steps):
            tokens, pos, labels = pad_batch((sft_batch if task == "sft" else dpo_batch)(c, step), 1)
            mask = document_mask(pos).to(dev)
            tokens, pos, labels = tokens.to(dev), pos.to(dev), labels.to(dev)

            def attend(q, k, v):
                return spa.softmax_attention(q, k, v, mask)

            lp = token_logprobs(model(tokens, pos, attend), labels)
            if step == 0:
                lp0 = lp.detach().to("cpu", copy=True)
            if task == "sft":
                loss = -lp.sum() / (labels >= 0).sum()
            else:
                seq = lp.sum(dim=1)
                with torch.no_grad():
                    rseq = token_logprobs(ref(tokens, pos, attend), labels).sum(dim=1)
                logits = c.beta * ((seq[0::2] - rseq[0::2]) - (seq[1::2] - rseq[1::2]))
                loss = -F.logsigmoid(logits).mean()
            opt.zero_grad()
            loss.backward()
            losses.append(loss.item())
            grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).to("cpu", copy=True))
            opt.step()
        out[task] = (losses, grads, lp0)
    return out


# ---------------------------------------------------------------- SP through spd


def train_rank(h, world, rank, size, c, ulysses, ring):
    """One rank of an SP configuration: per task what train_single returns, the
    log-probs for this rank's own tokens with their global indices, and the
    gradients from rank 0 only (every rank holds the same)."""
    torch.set_num_threads(1)
    dev = c.device_of(rank)
    mesh = h.mesh(sp=size, heads=c.heads, kv_heads=c.kv_heads, ulysses=ulysses, ring=ring)
    assert (mesh.ulysses, mesh.ring) == (ulysses, ring), mesh
    out = {}
    for task in ("sft", "dpo"):
        model = new_model(c, dev)
        ref = new_model(c, dev) if task == "dpo" else None
        params = list(model.parameters())
        opt = torch.optim.AdamW(params, lr=c.lr_sft if task == "sft" else c.lr_dpo, weight_decay=0.0)
        flat = h.empty((sum(p.numel() for p in params),), c.dtype, device=dev)   # arena, or the GPU
        avg = h.empty(tuple(flat.shape), c.dtype, device=dev)
        losses, grads, lp0 = [], [], None
        for step in range(c.steps):
            tokens, pos, labels = pad_batch((sft_batch if task == "sft" else dpo_batch)(c, step), size)
            layout = spa.SeqLayout.for_mesh(pos, mesh)          # once per batch, on the host
            mine = layout.local
            tokens, labels, positions = tokens[:, mine].to(dev), labels[:, mine].to(dev), layout.position_ids.to(dev)

            def attend(q, k, v):
                return spa.attention(h, mesh, layout, q, k, v, c.heads, c.kv_heads)

            lp = token_logprobs(model(tokens, positions, attend), labels)
            if step == 0:
                lp0 = (mine, lp.detach().to("cpu", copy=True))
            if task == "sft":
                n = (labels >= 0).sum()
                loss = spt.token_mean_loss(h, mesh.sp_group, -lp.sum(), n)
            else:
                part = lp.sum(dim=1)                               # this rank's share of each sequence
                with torch.no_grad():
                    rpart = token_logprobs(ref(tokens, positions, attend), labels).sum(dim=1)
                loss = spt.dpo_loss(h, mesh.sp_group, part[0::2], part[1::2], rpart[0::2], rpart[1::2],
                                    beta=c.beta)
            opt.zero_grad()
            loss.backward()
            # Each rank holds its share of the gradient times sp (the loss
            # all-reduce's backward sums); average over the SP group as data
            # parallelism does, in rank order, so every rank keeps the same bits.
            # Not in place: an all-reduce that reads only its input runs again
            # whole when a new spd takes the ranks over.
            torch.cat([p.grad.reshape(-1) for p in params], out=flat)
            h.allreduce(mesh.sp_group, flat, avg)
            avg /= size
            off = 0
            for p in params:
                p.grad.copy_(avg[off:off + p.numel()].view_as(p))
                off += p.numel()
            losses.append(loss.item())
            if rank == 0:
                grads.append(avg.to("cpu", copy=True))
            opt.step()
            if rank == 0 and task == "sft" and step == c.restart_at:
                os.write(c.say_fd, b"k")      # restart_check kills spd now, under the running ranks
        out[task] = (losses, grads, lp0)
    out["resumes"] = h.resume_info().resumes     # times a new spd took this rank over
    return out


def _host(x):
    """x with every tensor in it copied to the host. A CUDA tensor unpickled in
    the parent would start CUDA there, and the ranks it forks next could not."""
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return type(x)(*(_host(v) for v in x))
    if isinstance(x, (list, tuple)):
        return type(x)(_host(v) for v in x)
    if isinstance(x, dict):
        return {k: _host(v) for k, v in x.items()}
    return x


def _rank_main(job, size, rank, fn, args, conn):
    try:
        sock = SOCKETS[rank * len(SOCKETS) // size] if SOCKETS else None
        h = spclient.attach(socket=sock, name=f"rank{rank}")
        world = h.join(job, size, rank)
        result = _host(fn(h, world, rank, size, *args))
        h.close()
        msg = ("ok", result)
    except BaseException:
        msg = ("error", traceback.format_exc())
    # Plain pickle: tensors travel by value, not as shared storage of a process
    # that is about to exit.
    conn.send_bytes(pickle.dumps(msg))
    conn.close()


def run_ranks(size, fn, *args, timeout=600, meanwhile=None):
    """fn(h, world, rank, size, *args) in `size` forked rank processes of a new job;
    returns their results by rank, or raises with a failed rank's traceback.
    meanwhile: called here while the ranks run."""
    ctx = multiprocessing.get_context("fork")
    with spclient.attach(socket=SOCKETS[0] if SOCKETS else None) as owner:
        job = owner.job_create()
        procs = []
        for r in range(size):
            rd, wr = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_rank_main, args=(job, size, r, fn, args, wr))
            p.start()
            wr.close()
            procs.append((p, rd))
        if meanwhile is not None:
            meanwhile()
        results, errors = [], []
        for r, (p, rd) in enumerate(procs):
            if rd.poll(timeout):
                try:
                    kind, value = pickle.loads(rd.recv_bytes())
                except EOFError:
                    kind, value = "error", "died without a word"
            else:
                kind, value = "error", f"no answer in {timeout} s"
            p.join(5)
            if p.is_alive():
                p.kill()
            if kind == "error":
                errors.append(f"rank {r}: {value}")
            results.append(value)
    if errors:
        raise RuntimeError("\n".join(errors))
    return results


# ---------------------------------------------------------------- comparing


def compare(ref, ranks):
    """Per task: max |dloss|, max |dgrad|, and over every rank's tokens the max
    |dlogprob| at step 0 and whether those log-probs are bitwise equal."""
    rows = {}
    for task in ("sft", "dpo"):
        rl, rg, rlp = ref[task]
        gl, gg, _ = ranks[0][task]
        dloss = max(abs(a - b) for a, b in zip(rl, gl))
        dgrad = max(float((a - b).abs().max()) for a, b in zip(rg, gg))
        dlp, equal = 0.0, True
        for out in ranks:
            mine, glp = out[task][2]
            real = mine < rlp.shape[1]          # SP = 1 padded less; pads carry no label
            a, b = glp[:, real], rlp[:, mine[real]]
            dlp, equal = max(dlp, float((a - b).abs().max())), equal and torch.equal(a, b)
        rows[task] = (dloss, dgrad, dlp, equal)
    return rows


def _wait_attach(sock, proc, log):
    deadline = time.time() + 10
    while True:
        try:
            spclient.attach(socket=sock).close()
            return
        except spclient.SpdError:
            if time.time() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError(f"spd did not start; its log: {log}")
            time.sleep(0.05)


def start_spd(binary, nodes=1):
    """Starts `nodes` private spd daemons (linked as a cluster on loopback when
    more than one, each a node of its own) and sets SOCKETS (and SPC_SOCKET to
    the first). Returns a function that stops them."""
    d = tempfile.mkdtemp(prefix="spd-train-")
    procs, listen = [], []
    secret = os.path.join(d, "secret")
    if nodes > 1:
        with open(os.open(secret, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
            f.write(os.urandom(16).hex())
    env = dict(os.environ, NOTIFY_SOCKET="")
    SOCKETS.clear()
    for i in range(nodes):
        sock = os.path.join(d, f"node{i}", "spd.sock")
        args = [binary, "--set", f"socket={sock}", "--set", f"log_file={d}/node{i}.log"]
        if nodes > 1:
            args += ["--set", f"node_name=node{i}", "--set", f"cluster_secret_file={secret}",
                     "--set", "peer_listen=127.0.0.1:0", "--set", "peers=" + ",".join(listen),
                     "--set", "peer_restart_grace_ms=20000"]
        procs.append(subprocess.Popen(args, env=env))
        _wait_attach(sock, procs[-1], f"{d}/node{i}.log")
        SOCKETS.append(sock)

        def restart(i=i, args=args, sock=sock):   # the last node dials every other again
            procs[i].send_signal(signal.SIGKILL)
            procs[i].wait(10)
            procs[i] = subprocess.Popen(args, env=env)   # logs on, to the same file
            _wait_attach(sock, procs[i], f"{d}/node{i}.log")
        RESTART[:] = [restart]
        if nodes > 1:
            with spclient.attach(socket=sock) as h:
                listen.append(h.query("status")[0]["peer_listen"])
    if nodes > 1:   # the last one dialled every other: its links up means all are
        deadline = time.time() + 10
        with spclient.attach(socket=SOCKETS[-1]) as h:
            while h.query("status")[0]["peers_up"] < nodes - 1:
                if time.time() > deadline:
                    raise RuntimeError(f"the daemons did not link up; logs in {d}")
                time.sleep(0.05)
    os.environ["SPC_SOCKET"] = SOCKETS[0]

    def stop():
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            p.wait(15)
        SOCKETS.clear()
        RESTART.clear()
        shutil.rmtree(d, ignore_errors=True)
    return stop


def _call_main(fn, args, conn):
    try:
        msg = ("ok", _host(fn(*args)))
    except BaseException:
        msg = ("error", traceback.format_exc())
    conn.send_bytes(pickle.dumps(msg))
    conn.close()


def in_child(fn, *args, timeout=600):
    """fn(*args) in a forked process; returns its result or raises with its
    traceback. SP = 1 runs so on a GPU: the CUDA driver does not survive a fork,
    so this process, which forks the ranks, must never initialise it."""
    ctx = multiprocessing.get_context("fork")
    rd, wr = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_call_main, args=(fn, args, wr))
    p.start()
    wr.close()
    kind, value = pickle.loads(rd.recv_bytes()) if rd.poll(timeout) else ("error", f"no answer in {timeout} s")
    p.join(5)
    if p.is_alive():
        p.kill()
    if kind == "error":
        raise RuntimeError(value)
    return value


def experiment(dtype, steps, configs=CONFIGS, log=print, device="cpu"):
    """Runs SP = 1 and every configuration on `device` ("cpu" or "cuda"); returns
    {name: compare rows} and the loss curves {name: {task: losses}}."""
    c = Cfg(dtype, steps, device=device)
    ref = train_single(c) if device == "cpu" else in_child(train_single, c)
    curves = {"SP=1": {t: ref[t][0] for t in ref}}
    table = {}
    for name, u, r in configs:
        t0 = time.time()
        ranks = run_ranks(u * r, train_rank, c, u, r)
        table[name] = compare(ref, ranks)
        curves[name] = {t: ranks[0][t][0] for t in ("sft", "dpo")}
        log(f"  {name}: {time.time() - t0:.1f} s")
    return table, curves


def restart_check(dtype, steps, restart_at, configs=CONFIGS, log=print):
    """Trains every configuration twice, the second time with spd (with several
    nodes, the last one's) SIGKILLed after SFT step restart_at and another
    started on its socket; returns {name: (final SFT loss uninterrupted, final
    SFT loss across the restart, whether every loss and gradient of both tasks
    is the same, bit for bit)}. Raises unless the new spd took each of its
    ranks over once, and no other."""
    out = {}
    for name, u, r in configs:
        c = Cfg(dtype, steps)
        plain = run_ranks(u * r, train_rank, c, u, r)
        c.restart_at = restart_at
        rd, c.say_fd = os.pipe()

        def kill_when_told():
            os.close(c.say_fd)
            # Nothing comes when the ranks failed first: run_ranks says why.
            if select.select([rd], [], [], 600)[0] and os.read(rd, 1) == b"k":
                RESTART[0]()
        try:
            again = run_ranks(u * r, train_rank, c, u, r, meanwhile=kill_when_told)
        finally:
            os.close(rd)
        n, nodes = u * r, max(len(SOCKETS), 1)
        want = [int(k * nodes // n == nodes - 1) for k in range(n)]   # the ranks of the restarted node
        if [o["resumes"] for o in again] != want:
            raise RuntimeError(f"{name}: ranks taken over {[o['resumes'] for o in again]} times, not {want}")
        same = all(plain[0][t][0] == again[0][t][0] and
                   all(torch.equal(a, b) for a, b in zip(plain[0][t][1], again[0][t][1])) for t in ("sft", "dpo"))
        out[name] = (plain[0]["sft"][0][-1], again[0]["sft"][0][-1], same)
        log(f"  {name}: final SFT loss {out[name][0]!r} uninterrupted, {out[name][1]!r} across the restart")
    return out


def plot(curves64, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    for col, task in enumerate(("sft", "dpo")):
        ref = curves64["SP=1"][task]
        for i, (name, c) in enumerate(curves64.items()):
            ax[0, col].plot(range(1, len(c[task]) + 1), c[task], label=name,
                            linestyle="-" if i == 0 else "--", linewidth=3 if i == 0 else 1.2)
            if name != "SP=1":
                d = [max(abs(a - b), 1e-18) for a, b in zip(c[task], ref)]
                ax[1, col].semilogy(range(1, len(d) + 1), d, marker="o", markersize=3, label=name)
        ax[0, col].set_title(f"{task.upper()} loss (fp64)")
        ax[1, col].set_title(f"{task.upper()}: |loss - loss(SP=1)| (1e-18 = equal)")
        ax[1, col].set_xlabel("step")
        ax[1, col].set_ylim(1e-19, 1e-9)
    ax[0, 0].legend(fontsize=8)
    ax[1, 0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--spd", help="start a private spd from this binary (else use $SPC_SOCKET's)")
    ap.add_argument("--nodes", type=int, default=1,
                    help="with --spd: start this many daemons, linked, and spread the ranks over them")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--png", default="sp_loss_curves.png", help="where the loss curves go ('' for none)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="where the model and every op's tensors live (cuda: rank r on GPU r mod the GPU count)")
    ap.add_argument("--restart-at", type=int, metavar="STEP",
                    help="with --spd: train each configuration (fp64, on cpu) again with spd (with --nodes, the "
                         "last node's) SIGKILLed after SFT step STEP and another started under the ranks, and "
                         "compare the runs bit for bit")
    args = ap.parse_args()
    if args.nodes > 1 and not args.spd:
        ap.error("--nodes starts daemons: give --spd")
    if args.restart_at is not None and (not args.spd or not 0 <= args.restart_at < args.steps):
        ap.error("--restart-at restarts a private spd under the jobs: give --spd and a step below --steps")
    stop = start_spd(args.spd, args.nodes) if args.spd else None
    try:
        if args.restart_at is not None:
            print(f"float64: {args.steps} steps per configuration, uninterrupted and with spd killed after "
                  f"SFT step {args.restart_at}")
            runs = restart_check(torch.float64, args.steps, args.restart_at)
            same = [name for name, (_, _, equal) in runs.items() if equal]
            print(f"every loss and gradient the same bit for bit across the restart: {len(same)} of {len(runs)} "
                  "configurations")
            return 0 if len(same) == len(runs) else 1
        results = {}
        for dtype, target in ((torch.float64, 1e-10), (torch.float32, 1e-5)):
            print(f"{str(dtype)[6:]}: {args.steps} steps, SP = 1 and {len(CONFIGS)} SP configurations "
                  f"on {args.device}")
            results[dtype] = experiment(dtype, args.steps, device=args.device)
        print()
        print("| dtype | configuration | task | max abs loss diff | max abs grad diff "
              "| log-prob diff at lr 0 | bitwise |")
        print("|---|---|---|---|---|---|---|")
        ok = True
        for dtype, target in ((torch.float64, 1e-10), (torch.float32, 1e-5)):
            for name, rows in results[dtype][0].items():
                for task, (dl, dg, dlp, eq) in rows.items():
                    ok &= dl <= target
                    print(f"| {str(dtype)[6:]} | {name} | {task.upper()} | {dl:.2e} | {dg:.2e} | {dlp:.2e} "
                          f"| {'yes' if eq else 'no'} |")
        print()
        print("targets: loss difference <= 1e-10 (fp64), <= 1e-5 (fp32):", "met" if ok else "NOT met")
        if args.png:
            try:
                plot(results[torch.float64][1], args.png)
                print(f"loss curves: {args.png}")
            except ImportError:
                print("no PNG: matplotlib is not installed (apt-get install python3-matplotlib)")
        return 0 if ok else 1
    finally:
        if stop:
            stop()


if __name__ == "__main__":
    sys.exit(main())
