"""Drop-in attention APIs of other sequence-parallel libraries, running on spd.

spclient.compat.deepspeed.DistributedAttention and spclient.compat.yunchang's
UlyssesAttention, LongContextAttention and set_seq_parallel_pg take the
arguments those projects document and lay tensors out as they do, so model
code written against them switches by its import. Underneath, Ulysses is spd's
all-to-all (q, k and v in one op) and the ring is spclient.attention's, so
they also take what those projects refuse: a head count the group does not
divide (spd pads dummy heads), fewer key/value heads than ranks (spd
replicates them), and sequence pieces of any length.

What a process group is here. Where DeepSpeed and yunchang take a
torch.distributed ProcessGroup, these take either

  * a torch.distributed ProcessGroup (None: the default group), as the model
    code already passes. The first one makes this process's spd handle (the
    session, attached to $SPC_SOCKET or the default socket): torch's rank 0
    creates an spd job, torch.distributed broadcasts its id, and every rank
    joins it with its torch rank. A group is then the
    Ulysses group of an spd mesh of its size, which must hold the same ranks
    in the same order (consecutive ranks, as `new_group(range(i * P, (i + 1)
    * P))` makes them); spd's placement decides, and where it placed the
    ranks otherwise every rank is told so, not fed wrong tokens. Nothing else
    in the script changes;
  * a ProcessGroup of this module: an spd handle and one of its groups
    (ProcessGroup(h, mesh.ulysses_group)), for scripts that attach to spd
    themselves; no torch.distributed is needed then. That is the one line
    that changes, the group's creation.

Every rank constructs the modules in the same order (as DeepSpeed and yunchang
require too): a new group size makes a mesh, which all ranks create together.
"""
import torch

from .. import Group, HEADS_KV, HEADS_Q, BSHD, SBHD, attach
from .. import torch as spt

__all__ = ["ProcessGroup", "process_group", "session"]


class ProcessGroup:
    """An spd group and the handle whose ops run on it: what the compat modules
    run their collectives on. size() and rank() as torch's ProcessGroup has
    them."""

    def __init__(self, h, group):
        self.h, self.group = h, group

    def size(self):
        return self.group.size

    def rank(self):
        return self.group.rank

    def __repr__(self):
        return f"spclient.compat.ProcessGroup({self.group!r})"


class _Session:
    """This process's spd handle in a job whose ranks are torch.distributed's,
    and the meshes made for it, by spec."""

    def __init__(self):
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("spclient.compat: a torch.distributed group was given, but torch.distributed is not "
                               "initialized; initialize it, or pass spclient.compat.ProcessGroup(h, group) of an "
                               "spd handle")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.h = attach(name=f"rank{self.rank}")
        job = [self.h.job_create() if self.rank == 0 else None]
        dist.broadcast_object_list(job, src=0)
        self.h.join(job[0], self.world_size, self.rank)
        self.meshes = {}

    def mesh(self, sp, ulysses, ring):
        """The job's mesh of sp = ulysses x ring, made the first time it is asked
        for (by every rank at once, as modules are constructed)."""
        key = (sp, ulysses, ring)
        if key not in self.meshes:
            # The head count only sizes auto degrees, which are not asked for:
            # one head per Ulysses rank passes its check; the ops carry their own.
            self.meshes[key] = self.h.mesh(sp, heads=ulysses, ulysses=ulysses, ring=ring)
        return self.meshes[key]


_session = None

# Why a group spd made may hold other ranks than the script's (spclient.h, spc_mesh_create).
PLACEMENT = ("spd lays a mesh out Ulysses innermost, over consecutive ranks on one host, else over the ranks "
             "ordered by their GPUs' links")


def session():
    """This process's spd handle under torch.distributed (made by the first
    torch group the compat modules were given; see the module's text)."""
    global _session
    if _session is None:
        _session = _Session()
    return _session.h


def mesh(sp, ulysses, ring, handle=None):
    """(handle, mesh of sp = ulysses x ring): handle's new mesh, or without
    one the session's (made once per spec)."""
    if handle is not None:
        return handle, handle.mesh(sp, heads=ulysses, ulysses=ulysses, ring=ring)
    session()
    return _session.h, _session.mesh(sp, ulysses, ring)


def all_agree(h, mesh, ok):
    """Whether ok holds on every rank of the mesh's job: one all-reduce over
    the SP group and one over the DP group (world = dp x sp)."""
    flag = h.empty((1,), torch.int64)
    flag[0] = 0 if ok else 1
    for g in (mesh.sp_group, mesh.dp_group):
        if g.size > 1:
            h.allreduce(g, flag)
    return int(flag[0]) == 0


def _members(h, group, rank):
    """The job ranks of an spd group, in group order: one all-gather."""
    send = h.empty((1,), torch.int64)
    send[0] = rank
    recv = h.empty((group.size,), torch.int64)
    h.allgather(group, send, recv)
    return recv.tolist()


def _from_torch(pg):
    """The spd group of torch ProcessGroup pg: the Ulysses group of the mesh of
    its size, checked to hold pg's ranks in pg's order on every rank."""
    dist = torch.distributed
    if pg is None:
        pg = dist.group.WORLD
    ranks = dist.get_process_group_ranks(pg)
    h, m = mesh(len(ranks), len(ranks), 1)
    members = _members(h, m.ulysses_group, _session.rank)
    if not all_agree(h, m, members == ranks):
        raise ValueError(f"spclient.compat: spd's mesh of {len(ranks)} placed torch rank {_session.rank} with ranks "
                         f"{members} and the torch group holds {ranks}, here or on another rank: {PLACEMENT}; make "
                         f"the groups with spclient.compat.ProcessGroup(h, mesh.ulysses_group) instead")
    return ProcessGroup(h, m.ulysses_group)


def process_group(group):
    """The ProcessGroup that group names: one of this module's as it is, a
    torch.distributed ProcessGroup (or None, the default one) through the
    session (see the module's text)."""
    if isinstance(group, ProcessGroup):
        return group
    if isinstance(group, Group):
        raise TypeError("spclient.compat: an spd Group runs ops through its handle: pass "
                        "spclient.compat.ProcessGroup(h, group)")
    return _from_torch(group)


# ---------------------------------------------------------------- Ulysses


def layout_of(scatter_idx, gather_idx):
    """spd's layout of 4-d q, k, v that DeepSpeed's or yunchang's all-to-all
    scatters at scatter_idx (the heads, 2) and gathers at gather_idx (the
    sequence): 0 is [S, B, H, D], 1 is [B, S, H, D]."""
    s, g = scatter_idx % 4, gather_idx % 4
    if s != 2 or g not in (0, 1):
        raise ValueError(f"scatter_idx {scatter_idx}, gather_idx {gather_idx}: spd's all-to-all scatters the heads "
                         f"(dim 2) of 4-d q, k, v and gathers the sequence, dim 0 ([S, B, H, D]) or 1 "
                         f"([B, S, H, D])")
    return SBHD if g == 0 else BSHD


class Split:
    """Where a sequence lies over a group: rank r holds lengths[r] tokens, in
    rank order. The all-to-all runs on pieces of `piece` rows over a sequence
    of seq_len: spd's own split (ceil(S / P) a rank, the last ones fewer, all
    equal when P divides S) is that with seq_len = S; any other is run as P
    pieces of the longest, and `real` (None for spd's split) indexes the real
    rows of that padded sequence."""

    def __init__(self, lengths, rank):
        P, S = len(lengths), sum(lengths)
        self.lengths, self.n = lengths, lengths[rank]
        ceil = -(-S // P)
        if all(n == min(ceil, max(S - r * ceil, 0)) for r, n in enumerate(lengths)):
            self.seq_len, self.piece, self.real = S, ceil, None
        else:
            m = max(lengths)
            self.seq_len, self.piece = P * m, m
            self.real = torch.cat([torch.arange(r * m, r * m + n) for r, n in enumerate(lengths)])

    @classmethod
    def of(cls, pg, n):
        """The split of a group whose rank holds n tokens: one all-gather of the lengths."""
        h, group = pg.h, pg.group
        send = h.empty((1,), torch.int64)
        send[0] = n
        recv = h.empty((group.size,), torch.int64)
        h.allgather(group, send, recv)
        return cls(recv.tolist(), group.rank)


def _seq_dim(layout):
    return 0 if layout == SBHD else 1


def seq_to_head(pg, split, layout, q, k, v):
    """Ulysses before attention, in one all-to-all: this rank's pieces of q
    [.., H, D] and k, v [.., Hk, D] (the sequence at dim 0 or 1 by layout) ->
    the whole sequence of this rank's heads, H_loc and Hk_loc of them, dummies
    included: query head i of a rank uses its key/value head i // (H_loc /
    Hk_loc), as DeepSpeed's split gives where the group divides the heads.
    With autograd (the backward is head->seq, summing replicated KV heads)."""
    dim = _seq_dim(layout)
    H, Hk = _dealt(q.shape[2], k.shape[2], pg.size())
    q = _pad_heads(q, H)
    k, v = (_pad_heads(x, Hk) for x in (k, v))
    xs = [_pad_rows(x, dim, split.piece) for x in (q, k, v)]
    # Without GQA, k and v are dealt as q is, dummy heads and all; with it,
    # by their groups of query heads.
    kind = HEADS_Q if Hk == H else HEADS_KV
    xs = spt.seq_to_head(pg.h, pg.group, split.seq_len, (H, Hk, Hk), *xs, layout=layout,
                         kinds=(HEADS_Q, kind, kind), kv_heads=_groups(H, Hk))
    if split.real is not None:
        xs = [x.index_select(dim, split.real.to(x.device)) for x in xs]
    return xs


def head_to_seq(pg, split, layout, o, heads, kv_heads):
    """Ulysses after attention: o of this rank's heads of the whole sequence ->
    this rank's tokens of all `heads` heads (kv_heads: the key/value heads the
    query heads were dealt by)."""
    dim = _seq_dim(layout)
    H, Hk = _dealt(heads, kv_heads, pg.size())
    if split.real is not None:
        shape = list(o.shape)
        shape[dim] = split.seq_len
        o = o.new_zeros(shape).index_copy(dim, split.real.to(o.device), o)
    (o,) = spt.head_to_seq(pg.h, pg.group, split.seq_len, (H,), o, layout=layout, kv_heads=_groups(H, Hk))
    if split.n != split.piece:
        o = o.narrow(dim, 0, split.n)
    return o.narrow(2, 0, heads) if H != heads else o


def _dealt(heads, kv_heads, P):
    """The (query, key/value) heads the all-to-all carries. spd deals groups of
    query heads (one a key/value head; one a head without GQA), padding them
    with dummy groups to a multiple of P, or, with fewer groups than P,
    replicating each to P / groups ranks; where P is not a multiple of fewer
    groups, zero groups are added here, up to P, and dropped after."""
    if kv_heads >= P or P % kv_heads == 0:
        return heads, kv_heads
    return heads // kv_heads * P, P


def _pad_heads(x, heads):
    """x with zero heads appended along dim 2 up to `heads`."""
    extra = heads - x.shape[2]
    return x if extra == 0 else torch.nn.functional.pad(x, [0, 0, 0, extra])


def _groups(heads, kv_heads):
    """spd's kv_heads of an all-to-all: the query-head groups under GQA, 0 (one
    group a head) without."""
    return 0 if kv_heads == heads else kv_heads


def _pad_rows(x, dim, rows):
    """x with zero rows appended along dim up to `rows`."""
    extra = rows - x.shape[dim]
    if extra == 0:
        return x
    after = [0, 0] * (x.dim() - 1 - dim)
    return torch.nn.functional.pad(x, after + [0, extra])
