"""Where the tokens of one batch live over sequence-parallel ranks (SeqLayout).

The sequence of S tokens is padded, inside the layout, to a length Sp that
splits evenly: a multiple of the Ulysses size U with no ring, of 2 x R x U with
a ring of R ranks. The padded sequence is split zigzag over the ring ranks
(chunks r and 2R-1-r of 2R, so every ring rank does the same causal work) and
each ring shard is cut into U equal pieces, one per Ulysses rank. The padding
tokens are the last Sp - S of the sequence, so they end every shard and piece
they fall into; they form a document of their own, which no real token sees.
A rank feeds the model its real tokens only (layout.local) with their global
position ids: an SP boundary is not a document boundary, a packed document's
start is. attention() pads its q, k, v with layout.pad() and cuts the output
back with layout.unpad().

Documents come from the position ids. 1-D ids [B, S]: a document starts where
the position is 0 or does not follow the previous one (spclient.torch.cu_seqlens).
mRoPE ids [3, B, S] (Qwen2-VL; any [K, B, S]): from row 0, the temporal one,
where a document starts at 0 or where the row goes down. Within a document the
row never goes down, but it does not go up by one either (an image's patches
share one temporal position, the text after it goes on past the largest), so
the 1-D rule would cut at every image. A document's first token must be its
only one at temporal position 0, as with Qwen2-VL's templates, which start
with text.

A layout comes from the full ids on every rank (SeqLayout(...), for_mesh) or
from each rank's own shard (from_local), gathered over the SP group.
"""
import torch

from . import MismatchError
from . import torch as spt


def _is_mrope(position_ids):
    return position_ids.dim() == 3


def _continues(prev, cur, mrope):
    """Whether position cur, after prev, stays in prev's document."""
    return (cur != 0) & ((cur >= prev) if mrope else (cur == prev + 1))


def document_ids(position_ids):
    """[B, S] document index of every token of [B, S] position ids, or of mRoPE
    [K, B, S] ids (from their temporal row 0)."""
    mrope = _is_mrope(position_ids)
    pos = position_ids[0] if mrope else position_ids
    start = torch.ones_like(pos, dtype=torch.bool)
    start[:, 1:] = ~_continues(pos[:, :-1], pos[:, 1:], mrope)
    return torch.cumsum(start.to(torch.int64), dim=1) - 1


def _padded_len(seq_len, ulysses, ring):
    """The length the layout splits: S up to a multiple of what its pieces need."""
    unit = 2 * ring * ulysses if ring > 1 else ulysses
    return -(-seq_len // unit) * unit


class SeqLayout:
    """Where the tokens of one batch live over `ulysses` x `ring` ranks, computed
    once per batch (see the module's text for the rules).

    seq_len:    S, the real tokens of a row
    padded_len: Sp, what the shards split (S, when it splits already)
    shard_len:  Sp / ring, the tokens of one ring shard (of one K/V block)
    shard(j):   global token indices of ring rank j's shard, padding included
    local:      global indices of this rank's real tokens (index the batch with it)
    doc:        [B, Sp] document id of every token; the padding is one more document
    position_ids: this rank's position ids ([B, n] or mRoPE [K, B, n])
    """

    def __init__(self, position_ids, ulysses=1, ulysses_rank=0, ring=1, ring_rank=0):
        """From the full [B, S] (or mRoPE [K, B, S]) position ids of the batch."""
        self._place(position_ids.shape[-1], ulysses, ulysses_rank, ring, ring_rank)
        self._set_docs(document_ids(position_ids))
        self.position_ids = position_ids[..., self.local]

    @classmethod
    def for_mesh(cls, position_ids, mesh):
        """The layout of spclient.Mesh `mesh` (its Ulysses and ring groups)."""
        return cls(position_ids, mesh.ulysses, mesh.ulysses_group.rank, mesh.ring, mesh.ring_group.rank)

    @classmethod
    def from_local(cls, h, mesh, local_position_ids, seq_len=None):
        """The layout from this rank's own position ids: [B, n] or mRoPE [K, B, n]
        of the tokens layout.local will name, in order (its real tokens, as
        SeqLayout(full ids) gives them). Every rank of the SP group calls it;
        one all-gather over the group carries each rank's ids (row 0 of mRoPE
        ones) with its claim of the layout, and every rank checks every claim.

        mesh: an spclient.Mesh, or a Group taken as Ulysses alone over it.
        seq_len: S of the batch; None when every rank holds S / sp tokens.

        The checks. The claims (degrees, ring and Ulysses coordinates, B, n, S,
        mRoPE rows) must agree with SP rank 0's, the coordinates be distinct,
        and n be the real tokens of the claimed piece. The positions are then
        put in global order and checked where the sequence passes from one
        rank's piece to another's: there a position either continues the
        document (one more than the previous; mRoPE: not less) or is 0, a
        document's start. Inside a piece any position goes. This finds ids made
        again on each rank after a zigzag split (a rank's second chunk goes on
        from its first, not from its neighbour's) and ids that do not start at
        0 at a boundary. It cannot find ids made again from 0 on each rank
        after a contiguous split: they look exactly like a batch packed so that
        a document starts at every boundary, and are taken as that. And a
        document whose ids start other than at 0 exactly at a boundary is
        refused, though legitimate: give such a batch's full ids to SeqLayout.

        Raises ValueError naming the SP rank (in mesh.sp_group) whose claim or
        ids do not fit, on every rank, with the same message. Ids of another
        size (B, or n without seq_len) make the ranks' gathers differ: spd
        refuses the gather (SPC_ERR_MISMATCH), and the ValueError carries its
        detail, which names the ranks. The group serves on either way.
        """
        group, U, u, R, r = _coordinates(mesh)
        ids = local_position_ids.detach().to("cpu", torch.int64)
        mrope = _is_mrope(ids)
        rows = ids[0] if mrope else ids
        B, n = rows.shape
        S = n * group.size if seq_len is None else seq_len
        self = cls.__new__(cls)
        self._place(S, U, u, R, r)
        claim = [U, R, u, r, B, n, S, ids.shape[0] if mrope else 0]
        claims, bodies = self._gather(h, group, claim, rows)
        full = self._merge_claims(claims, bodies, mrope)
        self._set_docs(document_ids(full[None] if mrope else full))
        self.position_ids = local_position_ids
        return self

    def _gather(self, h, group, claim, rows):
        """Every rank's claim [P, 8] and ids [P, B x piece] (-1 past its n): one
        all-gather of the claim and the ids, padded to the piece every rank of
        this layout holds, so that ranks that agree send the same count."""
        B, n = rows.shape
        piece = self.shard_len // self.ulysses
        send = h.empty((len(claim) + B * piece,), torch.int64)
        send[:len(claim)] = torch.tensor(claim)
        body = send[len(claim):].view(B, piece)
        body.fill_(-1)
        body[:, :min(n, piece)] = rows[:, :piece]
        recv = h.empty((group.size * send.numel(),), torch.int64)
        try:
            h.allgather(group, send, recv)
        except MismatchError as e:
            raise ValueError(f"SeqLayout.from_local: the SP ranks' local position ids differ in size (here, sp "
                             f"rank {group.rank}: [B, n] = [{B}, {n}] of S = {self.seq_len}, {send.numel()} words "
                             f"with the claim): {e.detail}") from None
        gathered = recv.clone().view(group.size, -1)
        return gathered[:, :len(claim)], gathered[:, len(claim):]

    # -- where tokens are

    def _place(self, seq_len, ulysses, ulysses_rank, ring, ring_rank):
        self.seq_len, self.ulysses, self.ring = seq_len, ulysses, ring
        self.ulysses_rank, self.ring_rank = ulysses_rank, ring_rank
        self.padded_len = _padded_len(seq_len, ulysses, ring)
        self.shard_len = self.padded_len // ring
        self.local = self._piece(ring_rank, ulysses_rank)
        self.local = self.local[self.local < seq_len]     # the padding ends a piece

    def _piece(self, ring_rank, ulysses_rank):
        """Global indices of one rank's piece of the padded sequence."""
        n = self.shard_len // self.ulysses
        return self.shard(ring_rank)[ulysses_rank * n:(ulysses_rank + 1) * n]

    def _set_docs(self, doc):
        """doc of the real tokens, the padding appended as one more document."""
        pad = self.padded_len - self.seq_len
        self.doc = torch.cat([doc, doc[:, -1:].expand(-1, pad) + 1], dim=1) if pad else doc

    def shard(self, j):
        """Global token indices of ring rank j's shard (one K/V block), padding included."""
        if self.ring > 1:
            return spt.zigzag_positions(self.padded_len, self.ring, j)
        return torch.arange(self.padded_len)

    # -- this rank's tensors

    @property
    def pad_len(self):
        """Padding tokens at the end of this rank's piece."""
        return self.shard_len // self.ulysses - self.local.numel()

    def pad(self, x, dim=1):
        """x of this rank's real tokens along dim, zeros appended for its padding
        tokens: what the all-to-all and the ring exchange. x itself without any."""
        if self.pad_len == 0:
            return x
        after = [0, 0] * (x.dim() - 1 - dim % x.dim())      # F.pad's pairs run from the last dim
        return torch.nn.functional.pad(x, after + [0, self.pad_len])

    def unpad(self, x, dim=1):
        """The real tokens of x, a tensor of this rank's piece along dim (a view);
        x itself without padding (autograd's backward of a narrow makes a
        zero tensor of x's size to copy the gradient into)."""
        if self.pad_len == 0:
            return x
        return x.narrow(dim, 0, self.local.numel())

    # -- from_local's checks

    def _merge_claims(self, claims, bodies, mrope):
        """Checks every rank's claim against SP rank 0's (so that every rank names
        the same one) and the layout, and puts their ids in place: the [B, S] ids
        (row 0 of mRoPE ones) of the batch."""
        claims = claims.tolist()
        U, R, _, _, B, _, S, K = claims[0]
        bodies = bodies.view(len(claims), B, -1)     # every rank's words: SP rank 0's B x piece

        def ids(k):
            return f"mRoPE ids of {k} rows" if k else "1-D ids"

        for p, (cu, cr, _, _, cb, _, cs, ck) in enumerate(claims):
            if (cu, cr, cb, cs, ck) != (U, R, B, S, K):
                hint = "; without seq_len, S is n x sp, so pieces of other lengths need it" if cs != S else ""
                raise ValueError(f"SeqLayout.from_local: sp rank {p} claims ulysses {cu} x ring {cr}, batch {cb}, "
                                 f"S = {cs}, {ids(ck)}; sp rank 0 claims {U} x {R}, {B}, {S}, {ids(K)}{hint}")
        where = {}
        for p, (_, _, uu, rr, _, cn, _, _) in enumerate(claims):
            if not (0 <= uu < U and 0 <= rr < R) or (rr, uu) in where:
                raise ValueError(f"SeqLayout.from_local: sp rank {p} claims ring rank {rr}, ulysses rank {uu}"
                                 + (f", as sp rank {where[(rr, uu)]} does" if (rr, uu) in where else
                                    f", outside ring {R} x ulysses {U}"))
            where[(rr, uu)] = p
            real = int((self._piece(rr, uu) < S).sum())
            if cn != real:
                raise ValueError(f"SeqLayout.from_local: sp rank {p} passes {cn} tokens a row; its piece (ring rank "
                                 f"{rr}, ulysses rank {uu}) of S = {S} holds {real}")
        full = torch.empty(B, self.padded_len, dtype=torch.int64)
        owner = torch.empty(self.padded_len, dtype=torch.int64)
        for (rr, uu), p in where.items():
            idx = self._piece(rr, uu)
            full[:, idx] = bodies[p]
            owner[idx] = p
        full, owner = full[:, :S], owner[:S]
        self._check_boundaries(full, owner, mrope)
        return full

    @staticmethod
    def _check_boundaries(full, owner, mrope):
        """Refuses positions that neither continue a document nor start one at 0
        where the sequence passes from one rank's piece to another's."""
        j = torch.nonzero(owner[1:] != owner[:-1]).reshape(-1) + 1
        prev, cur = full[:, j - 1], full[:, j]
        bad = ~_continues(prev, cur, mrope) & (cur != 0)
        if bool(bad.any()):
            b, i = (int(x) for x in torch.nonzero(bad)[0])
            t = int(j[i])
            follow = "at or after" if mrope else "one after"
            raise ValueError(f"SeqLayout.from_local: sp rank {int(owner[t])}'s position ids do not fit sp rank "
                             f"{int(owner[t - 1])}'s: at token {t} of row {b} position {int(cur[b, i])} follows "
                             f"{int(prev[b, i])}, neither {follow} it (the same document) nor 0 (a new one); "
                             "were the ids made again on each rank after sharding? Shard the global ids")


def _coordinates(mesh):
    """(SP group, ulysses, ulysses rank, ring, ring rank) of a Mesh, or of a Group
    taken as Ulysses alone."""
    if hasattr(mesh, "sp_group"):
        return mesh.sp_group, mesh.ulysses, mesh.ulysses_group.rank, mesh.ring, mesh.ring_group.rank
    return mesh, mesh.size, mesh.rank, 1, 0
