# torchrun --standalone --nproc_per_node 4 client/examples/quickstart.py
import torch

import spclient
import spclient.torch as spt

run = spclient.init()                     # rank, world size and job from torchrun: nothing to pass around
h, P, rank = run.handle, run.world_size, run.rank
mesh = h.mesh(sp=P, heads=8, ulysses=2)   # Ulysses groups of 2 inside, rings of P / 2 across them
U, u = mesh.ulysses, mesh.ulysses_group.rank   # this rank's place in its Ulysses group
R, r = mesh.ring, mesh.ring_group.rank         # and in its ring

# Ulysses: each rank holds S / U tokens of all 8 heads; after the all-to-all,
# all S tokens of 8 / U heads. (Each ring rank's block of the sequence differs.)
S, H, D = 16, 8, 4
block = torch.arange(S * H * D, dtype=torch.float32).reshape(1, S, H, D) + 1000 * r
q = block[:, u * S // U:(u + 1) * S // U]
(q_heads,) = spt.seq_to_head(h, mesh.ulysses_group, S, [H], q)
assert torch.equal(q_heads, block[:, :, u * H // U:(u + 1) * H // U])
(q_back,) = spt.head_to_seq(h, mesh.ulysses_group, S, [H], q_heads)
assert torch.equal(q_back, q)

# Ring: K/V go to ring rank + 1 and come from ring rank - 1.
kv = torch.full((2, S, D), float(r))
(kv_prev,) = spt.shift(h, mesh.ring_group, kv)
assert torch.equal(kv_prev, torch.full((2, S, D), float((r - 1) % R)))

# The loss: token-weighted mean over every rank (rank k has k + 1 tokens of loss 2 each).
loss = spt.token_mean_loss(h, run.world, torch.tensor(2.0 * (rank + 1)), torch.tensor(rank + 1))
assert loss.item() == 2.0

if rank == 0:
    print(f"{P} ranks of {run.job}: {mesh}, all-to-all, ring shift and loss checked")
run.close()
