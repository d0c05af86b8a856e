#!/usr/bin/env python3
"""Trains a tiny hybrid model (linear-attention and softmax-attention layers)
with and without sequence parallelism through spd, and prints how far each SP
configuration drifts from SP = 1.

    python3 client/examples/train_hybrid_sp.py --spd build/daemon/spd     # starts a private spd
    python3 client/examples/train_hybrid_sp.py                            # uses $SPC_SOCKET's spd

The model, as Qwen3-Next and Qwen3.5 mix them: two GatedDeltaNet-like
linear-attention layers (q, k, v projections, 2 q/k heads and 4 value heads,
each q/k head read by two, a causal depthwise convolution of width 4 with SiLU,
L2-normalised q and k, the gated delta rule with beta = sigmoid(.) and the
decay g = -exp(A_log) softplus(a + dt_bias), an output norm gated by silu(z)),
then one softmax-attention layer (RoPE, causal grouped-query attention, 4
query and 2 KV heads); a SwiGLU MLP after each, RMSNorm. The data:
train_tiny_sp.py's packed documents (SFT), position ids restarting at every
document.

SP = 1 is one plain torch process, no spd, whose convolution and recurrence are
written out plainly here (torch's conv1d per document; the recurrence token by
token with its [Dk, Dk] transition matrices), sharing no code with
spclient.linear. Every other configuration forks one process per rank; each
feeds the model its own contiguous piece of the sequence (a SeqLayout of one
Ulysses group, which pads the sequence inside) and runs
  * the linear layers (spclient.linear) on a mesh of ulysses x ring ranks: the
    convolution on the pieces, its halo from the rank before; the recurrence
    by Ulysses over the Ulysses group (q, k, v, beta and the decay seq->head
    in one all-to-all, every rank the whole stretch for its heads, q/k heads
    replicated where they are fewer than the ranks) and by context parallelism
    over the ring (the state passed from every ring rank before, one
    all-gather of (h, M) pairs), all reset at the documents of the global
    position ids; the table's rows run CP alone, Ulysses alone and Ulysses
    inside CP;
  * the softmax layers with Ulysses over all the SP ranks (spclient.attention),
    on the same pieces.
The loss is the token mean over ranks, the gradients averaged over the SP
group as data parallelism averages them, as in train_tiny_sp.py.
"""
import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "python"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import spclient.attention as spa  # noqa: E402
import spclient.linear as spl  # noqa: E402
import spclient.torch as spt  # noqa: E402
import train_tiny_sp as tiny  # noqa: E402

# name, SP degree, the linear layers' Ulysses x ring; the softmax layers run Ulysses over all SP ranks
CONFIGS = [
    ("SP=2 linear CP 2, softmax Ulysses 2", 2, 1, 2),
    ("SP=2 linear Ulysses 2, softmax Ulysses 2", 2, 2, 1),
    ("SP=4 linear CP 4, softmax Ulysses 4 (KV replicated)", 4, 1, 4),
    ("SP=4 linear Ulysses 4 (q/k replicated), softmax Ulysses 4", 4, 4, 1),
    ("SP=4 linear Ulysses 2 x CP 2, softmax Ulysses 4", 4, 2, 2),
]


class Cfg(tiny.Cfg):
    vocab, dim, heads, kv_heads, ffn = 64, 32, 4, 2, 64
    lin_k_heads, lin_v_heads, dk, dv, conv = 2, 4, 8, 8, 4
    pattern = ("linear", "linear", "softmax")

    def __init__(self, dtype=torch.float64, steps=20, lr=3e-3):
        super().__init__(dtype, steps, lr_sft=lr)


# ---------------------------------------------------------------- the plain recurrence (SP = 1)


def documents(positions):
    """[(start, end)] of every document of 1-D position ids: one starts at 0 or
    where the position does not follow the previous one."""
    pos = positions.tolist()
    starts = [i for i in range(len(pos)) if i == 0 or pos[i] == 0 or pos[i] != pos[i - 1] + 1]
    return list(zip(starts, starts[1:] + [len(pos)]))


def plain_conv(x, weight, positions):
    """Causal depthwise convolution of x [B, S, C] (weight [C, k]) inside each
    document: torch's conv1d over each document with k-1 zeros on its left."""
    k = weight.shape[1]
    rows = []
    for b in range(x.shape[0]):
        parts = []
        for a, e in documents(positions[b]):
            seg = F.pad(x[b:b + 1, a:e].transpose(1, 2), (k - 1, 0))
            parts.append(F.conv1d(seg, weight[:, None], groups=x.shape[2]).transpose(1, 2))
        rows.append(torch.cat(parts, dim=1))
    return torch.cat(rows, dim=0)


def plain_gated_delta(q, k, v, beta, g, positions):
    """The gated delta rule token by token: per document, per head, the state S
    [Dk, Dv] from zero, S <- exp(g) (I - beta k k^T) S + beta k v^T, o = S^T q."""
    B, _, H, Dk = k.shape
    eye = torch.eye(Dk, dtype=k.dtype)
    rows = []
    for b in range(B):
        toks = []
        for a, e in documents(positions[b]):
            state = [torch.zeros(Dk, v.shape[-1], dtype=v.dtype) for _ in range(H)]
            for t in range(a, e):
                heads = []
                for j in range(H):
                    kt = k[b, t, j][:, None]
                    trans = torch.exp(g[b, t, j]) * (eye - beta[b, t, j] * kt @ kt.T)
                    state[j] = trans @ state[j] + beta[b, t, j] * kt @ v[b, t, j][None]
                    heads.append(state[j].T @ q[b, t, j])
                toks.append(torch.stack(heads))
        rows.append(torch.stack(toks))
    return torch.stack(rows)


class Single:
    """The ops of SP = 1: the plain recurrence and dense causal attention."""

    def __init__(self, c, positions):
        self.c, self.positions = c, positions
        self.mask = tiny.document_mask(positions)

    def conv(self, x, weight):
        return plain_conv(x, weight, self.positions)

    def gated_delta(self, q, k, v, beta, g):
        r = v.shape[2] // k.shape[2]       # value head j reads q/k head j // r
        return plain_gated_delta(q.repeat_interleave(r, dim=2), k.repeat_interleave(r, dim=2), v, beta, g,
                                 self.positions)

    def attend(self, q, k, v):
        return spa.softmax_attention(q, k, v, self.mask)


class Parallel:
    """The ops of one SP rank over one contiguous layout: the linear layers on
    linear_mesh (Ulysses x ring, spclient.linear), the softmax ones by Ulysses
    on mesh (all the SP ranks, no ring). layout: mesh's; its pieces are the
    linear mesh's too, its SP ranks being in the same order."""

    def __init__(self, h, mesh, linear_mesh, c, layout):
        self.h, self.mesh, self.c, self.layout = h, mesh, c, layout
        self.ctx = spl.LinearContext(h, linear_mesh.sp_group, layout, linear_mesh.ulysses_group,
                                     linear_mesh.ring_group)

    def conv(self, x, weight):
        return spl.short_conv(self.ctx, x, weight)

    def gated_delta(self, q, k, v, beta, g):
        return spl.gated_delta_rule(self.ctx, q, k, v, beta, g)

    def attend(self, q, k, v):
        return spa.attention(self.h, self.mesh, self.layout, q, k, v, self.c.heads, self.c.kv_heads)


# ---------------------------------------------------------------- the model


class LinearMixer(torch.nn.Module):
    """GatedDeltaNet, small: what Qwen3-Next's linear-attention layer computes."""

    def __init__(self, c):
        super().__init__()
        self.c = c
        Hk, H = c.lin_k_heads, c.lin_v_heads
        self.qkv = torch.nn.Linear(c.dim, 2 * Hk * c.dk + H * c.dv, bias=False)
        self.conv_w = torch.nn.Parameter(torch.randn(2 * Hk * c.dk + H * c.dv, c.conv) / c.conv)
        self.b = torch.nn.Linear(c.dim, H, bias=False)
        self.a = torch.nn.Linear(c.dim, H, bias=False)
        self.A_log = torch.nn.Parameter(torch.log(torch.linspace(1.0, 4.0, H)))
        self.dt_bias = torch.nn.Parameter(torch.zeros(H))
        self.z = torch.nn.Linear(c.dim, H * c.dv, bias=False)
        self.norm = torch.nn.Parameter(torch.ones(c.dv))
        self.out = torch.nn.Linear(H * c.dv, c.dim, bias=False)

    def forward(self, y, positions, ops):
        B, n, _ = y.shape
        c, Hk, H = self.c, self.c.lin_k_heads, self.c.lin_v_heads
        qkv = F.silu(ops.conv(self.qkv(y), self.conv_w))
        q, k, v = qkv.split([Hk * c.dk, Hk * c.dk, H * c.dv], dim=-1)
        q = F.normalize(q.view(B, n, Hk, c.dk), dim=-1) * c.dk ** -0.5
        k = F.normalize(k.view(B, n, Hk, c.dk), dim=-1)
        beta = torch.sigmoid(self.b(y))
        g = -torch.exp(self.A_log) * F.softplus(self.a(y) + self.dt_bias)
        o = ops.gated_delta(q, k, v.view(B, n, H, c.dv), beta, g)
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm
        o = o * F.silu(self.z(y).view(B, n, H, c.dv))
        return self.out(o.reshape(B, n, -1))


class SoftmaxMixer(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        self.wq = torch.nn.Linear(c.dim, c.heads * c.head_dim, bias=False)
        self.wk = torch.nn.Linear(c.dim, c.kv_heads * c.head_dim, bias=False)
        self.wv = torch.nn.Linear(c.dim, c.kv_heads * c.head_dim, bias=False)
        self.wo = torch.nn.Linear(c.heads * c.head_dim, c.dim, bias=False)

    def forward(self, y, positions, ops):
        B, n, _ = y.shape
        c = self.c
        q = tiny.rope(self.wq(y).view(B, n, c.heads, c.head_dim), positions)
        k = tiny.rope(self.wk(y).view(B, n, c.kv_heads, c.head_dim), positions)
        v = self.wv(y).view(B, n, c.kv_heads, c.head_dim)
        return self.wo(ops.attend(q, k, v).reshape(B, n, -1))


class Block(torch.nn.Module):
    def __init__(self, c, kind):
        super().__init__()
        self.n1, self.n2 = tiny.RMSNorm(c.dim), tiny.RMSNorm(c.dim)
        self.mixer = LinearMixer(c) if kind == "linear" else SoftmaxMixer(c)
        self.gate = torch.nn.Linear(c.dim, c.ffn, bias=False)
        self.up = torch.nn.Linear(c.dim, c.ffn, bias=False)
        self.down = torch.nn.Linear(c.ffn, c.dim, bias=False)

    def forward(self, x, positions, ops):
        x = x + self.mixer(self.n1(x), positions, ops)
        y = self.n2(x)
        return x + self.down(F.silu(self.gate(y)) * self.up(y))


class HybridLM(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed = torch.nn.Embedding(c.vocab, c.dim)
        self.blocks = torch.nn.ModuleList(Block(c, kind) for kind in c.pattern)
        self.norm = tiny.RMSNorm(c.dim)
        self.head = torch.nn.Linear(c.dim, c.vocab, bias=False)

    def forward(self, tokens, positions, ops):
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x, positions, ops)
        return self.head(self.norm(x))


def new_model(c):
    torch.manual_seed(1234)
    return HybridLM(c).to(c.dtype)


# ---------------------------------------------------------------- training


def train_single(c):
    """SP = 1: the losses, flat gradients per step and the step-0 log-probs."""
    torch.set_num_threads(1)
    model = new_model(c)
    opt = torch.optim.AdamW(model.parameters(), lr=c.lr_sft, weight_decay=0.0)
    losses, grads, lp0 = [], [], None
    for step in range(c.steps):
        tokens, pos, labels = tiny.sft_batch(c, step)
        lp = tiny.token_logprobs(model(tokens, pos, Single(c, pos)), labels)
        if step == 0:
            lp0 = lp.detach().clone()
        loss = -lp.sum() / (labels >= 0).sum()
        opt.zero_grad()
        loss.backward()
        losses.append(loss.item())
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
        opt.step()
    return losses, grads, lp0


def meshes(h, c, size, ulysses, ring):
    """The softmax layers' mesh (Ulysses over all size ranks) and the linear
    layers' (ulysses x ring)."""
    return (h.mesh(sp=size, heads=c.heads, kv_heads=c.kv_heads, ulysses=size, ring=1),
            h.mesh(sp=size, heads=c.lin_v_heads, kv_heads=c.lin_k_heads, ulysses=ulysses, ring=ring))


def train_rank(h, world, rank, size, c, ulysses, ring):
    """One rank: what train_single returns (gradients from rank 0 only), the
    step-0 log-probs with the global indices of this rank's tokens."""
    torch.set_num_threads(1)
    mesh, linear_mesh = meshes(h, c, size, ulysses, ring)
    model = new_model(c)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=c.lr_sft, weight_decay=0.0)
    flat = h.empty((sum(p.numel() for p in params),), c.dtype)
    losses, grads, lp0 = [], [], None
    for step in range(c.steps):
        tokens, pos, labels = tiny.sft_batch(c, step)
        layout = spa.SeqLayout.for_mesh(pos, mesh)      # global ids: an SP boundary is no document's
        mine = layout.local
        tokens, labels = tokens[:, mine], labels[:, mine]
        lp = tiny.token_logprobs(model(tokens, layout.position_ids, Parallel(h, mesh, linear_mesh, c, layout)),
                                labels)
        if step == 0:
            lp0 = (mine, lp.detach().clone())
        loss = spt.token_mean_loss(h, mesh.sp_group, -lp.sum(), (labels >= 0).sum())
        opt.zero_grad()
        loss.backward()
        torch.cat([p.grad.reshape(-1) for p in params], out=flat)
        h.allreduce(mesh.sp_group, flat)      # in rank order: every rank keeps the same bits
        flat /= size
        off = 0
        for p in params:
            p.grad.copy_(flat[off:off + p.numel()].view_as(p))
            off += p.numel()
        losses.append(loss.item())
        if rank == 0:
            grads.append(flat.clone())
        opt.step()
    return losses, grads, lp0


def compare(ref, ranks):
    """max |dloss|, max |dgrad|, over every rank's tokens the max |dlogprob| at
    step 0 and whether those are bitwise equal."""
    (rl, rg, rlp), (gl, gg, _) = ref, ranks[0]
    dloss = max(abs(a - b) for a, b in zip(rl, gl))
    dgrad = max(float((a - b).abs().max()) for a, b in zip(rg, gg))
    dlp, equal = 0.0, True
    for _, _, (mine, glp) in ranks:
        a, b = glp, rlp[:, mine]
        dlp, equal = max(dlp, float((a - b).abs().max())), equal and torch.equal(a, b)
    return dloss, dgrad, dlp, equal


def experiment(dtype, steps, configs=CONFIGS, log=print):
    """SP = 1 and every configuration: {name: compare's row}, {name: losses}."""
    c = Cfg(dtype, steps)
    ref = train_single(c)
    table, curves = {}, {"SP=1": ref[0]}
    for name, sp, ulysses, ring in configs:
        t0 = time.time()
        ranks = tiny.run_ranks(sp, train_rank, c, ulysses, ring)
        table[name] = compare(ref, ranks)
        curves[name] = ranks[0][0]
        log(f"  {name}: {time.time() - t0:.1f} s")
    return table, curves


TARGETS = ((torch.float64, 1e-10), (torch.float32, 1e-5))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--spd", help="start a private spd from this binary (else use $SPC_SOCKET's)")
    ap.add_argument("--nodes", type=int, default=1,
                    help="with --spd: start this many daemons, linked, and spread the ranks over them")
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    if args.nodes > 1 and not args.spd:
        ap.error("--nodes starts daemons: give --spd")
    stop = tiny.start_spd(args.spd, args.nodes) if args.spd else None
    try:
        results = {}
        for dtype, _ in TARGETS:
            print(f"{str(dtype)[6:]}: {args.steps} steps, SP = 1 and {len(CONFIGS)} SP configurations")
            results[dtype] = experiment(dtype, args.steps)[0]
        print()
        print("| dtype | configuration | task | max abs loss diff | max abs grad diff "
              "| log-prob diff at lr 0 | bitwise |")
        print("|---|---|---|---|---|---|---|")
        ok = True
        for dtype, target in TARGETS:
            for name, (dl, dg, dlp, eq) in results[dtype].items():
                ok &= dl <= target
                print(f"| {str(dtype)[6:]} | {name} | SFT | {dl:.2e} | {dg:.2e} | {dlp:.2e} "
                      f"| {'yes' if eq else 'no'} |")
        print()
        print("targets: loss difference <= 1e-10 (fp64), <= 1e-5 (fp32):", "met" if ok else "NOT met")
        return 0 if ok else 1
    finally:
        if stop:
            stop()


if __name__ == "__main__":
    sys.exit(main())
