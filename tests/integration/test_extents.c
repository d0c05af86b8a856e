/*
 * test_extents.c — a buffer too small for its op is refused before any byte
 * moves, whatever the op, and the memory after it is left alone.
 *
 * Every short buffer below is an arena allocation with a guard allocation right
 * after it, as a trainer's next tensor would be: spd checked arena tensors
 * against the whole arena only, and wrote past such buffers into the guard.
 *
 *   ulysses      7 heads on 4 ranks: a rank holds ceil(7/4) = 2 heads (rank 3
 *                one real and one dummy). A receive sized for 7 / 4 = 1 head is
 *                refused on every rank with INVALID_ARG naming the tensor, the
 *                256 bytes the op writes and the 128 the buffer holds; a receive
 *                of the right size then gets the right heads.
 *   padded rows  head->seq of 7 rows on 4 ranks: a receive needs ceil(7/4) = 2
 *                rows, padding included; one sized for 7 / 4 = 1 row is refused.
 *   collectives  all-reduce, all-gather, broadcast and shift with an output too
 *                small on one rank: it hears INVALID_ARG with both sizes, the
 *                others PEER_REFUSED naming it.
 *   freed        a tensor in an allocation already freed is refused at submit.
 *   raw          an entry written to the ring by hand, as another library might,
 *                that declares no length for its receive: spd refuses it and the
 *                partners hear why.
 * spd logs each refusal, and serves a fresh job afterwards.
 */
#include <stdlib.h>

#include "internal.h"   /* the segment's layout, to write an SQ entry by hand */
#include "sp_futex.h"
#include "sp_test.h"

#define P        4
#define D        4           /* head dim */
#define GUARD    256
#define MARK     0xA5
#define WAIT_MS  20000

static sp_test_daemon_t daemon_;

static float value(uint32_t row, uint32_t head, uint32_t d)
{
    return (float)(row * 1000 + head * 10 + d);
}

/* `bytes` (a multiple of 64) in the arena with GUARD bytes allocated right
 * after them; both marked. */
static void *alloc_guarded(spc_handle_t *h, size_t bytes, uint8_t **guard_p)
{
    uint8_t *buf = spc_alloc(h, bytes), *guard = spc_alloc(h, GUARD);
    CHECK(buf != NULL && guard != NULL);
    CHECK(guard == buf + bytes);   /* nothing between them: a write past buf lands in guard */
    memset(buf, MARK, bytes);
    memset(guard, MARK, GUARD);
    *guard_p = guard;
    return buf;
}

static void check_marked(const void *p, size_t bytes, const char *what)
{
    const uint8_t *b = p;
    for (size_t i = 0; i < bytes; i++)
        if (b[i] != MARK)
            SP_FAIL("%s: byte %zu is 0x%02x, was 0x%02x: spd wrote there", what, i, b[i], MARK);
}

static spc_alltoall_desc_t a2a_desc(spc_group_t g, uint32_t direction, uint32_t seq_len, uint32_t heads,
                                    const void *send, void *recv)
{
    spc_alltoall_desc_t d;
    memset(&d, 0, sizeof d);
    d.struct_size = sizeof d;
    d.group = g;
    d.dtype = SPC_F32;
    d.direction = direction;
    d.layout = SPC_LAYOUT_BSHD;
    d.batch = 1;
    d.seq_len = seq_len;
    d.ntensors = 1;
    d.tensors[0] = (spc_a2a_tensor_t){ send, recv, heads, D, SPC_HEADS_Q, 0 };
    return d;
}

/* ================================================================ ulysses */

static void ulysses(spc_handle_t *h, spc_group_t world, uint32_t p)
{
    enum { S = 8, H = 7, S_LOC = S / P, L = 2 };
    float *send = spc_alloc(h, S_LOC * H * D * sizeof(float));
    CHECK(send != NULL);
    for (uint32_t s = 0; s < S_LOC; s++)
        for (uint32_t hd = 0; hd < H; hd++)
            for (uint32_t d = 0; d < D; d++)
                send[(s * H + hd) * D + d] = value(p * S_LOC + s, hd, d);

    /* Sized as 7 // 4 = 1 head: [1, 8, 1, 4] floats, 128 bytes of the 256. */
    uint8_t *guard;
    float *small = alloc_guarded(h, S * 1 * D * sizeof(float), &guard);
    spc_alltoall_desc_t d = a2a_desc(world, SPC_SEQ_TO_HEAD, S, H, send, small);
    CHECK_ST(h, spc_alltoall(h, &d, WAIT_MS), SPC_ERR_INVALID_ARG);
    CHECK_CONTAINS(spc_last_error(h), "alltoall receive 0 tensor holds 128 bytes; the op needs 256");
    CHECK_CONTAINS(spc_last_error(h), "[1, 8, 2, 4] fp32");
    if (p == 0)
        printf("one head short: %s\n", spc_last_error(h));
    check_marked(small, S * D * sizeof(float), "the short receive");
    check_marked(guard, GUARD, "the allocation after the short receive");

    /* Two heads a rank: the op goes through, the dummy is zeros. */
    float *recv = alloc_guarded(h, S * L * D * sizeof(float), &guard);
    d.tensors[0].recv = recv;
    CHECK_OK(h, spc_alltoall(h, &d, WAIT_MS));
    for (uint32_t s = 0; s < S; s++)
        for (uint32_t l = 0; l < L; l++)
            for (uint32_t k = 0; k < D; k++) {
                uint32_t hd = p * L + l;
                CHECK_EQ(recv[(s * L + l) * D + k], hd < H ? value(s, hd, k) : 0.0f);
            }
    check_marked(guard, GUARD, "the allocation after the receive");
}

/* Head->seq of 7 rows: each rank writes ceil(7/4) = 2 rows (rank 3's second
 * is padding), 8 heads of dim 4: 256 bytes. */
static void padded_rows(spc_handle_t *h, spc_group_t world)
{
    enum { S = 7, H = 8, L = H / P };
    float *send = spc_alloc(h, S * L * D * sizeof(float));
    CHECK(send != NULL);
    memset(send, 0, S * L * D * sizeof(float));
    uint8_t *guard;
    float *small = alloc_guarded(h, 1 * H * D * sizeof(float), &guard);
    spc_alltoall_desc_t d = a2a_desc(world, SPC_HEAD_TO_SEQ, S, H, send, small);
    CHECK_ST(h, spc_alltoall(h, &d, WAIT_MS), SPC_ERR_INVALID_ARG);
    CHECK_CONTAINS(spc_last_error(h), "alltoall receive 0 tensor holds 128 bytes; the op needs 256");
    CHECK_CONTAINS(spc_last_error(h), "[1, 2, 8, 4] fp32");
    check_marked(small, H * D * sizeof(float), "the receive of one row");
    check_marked(guard, GUARD, "the allocation after the receive of one row");
}

/* ================================================================ collectives */

/*
 * Rank `bad` calls op with an output of `given` bytes where the op writes
 * `need`, the others with `need`: it hears INVALID_ARG naming the tensor and
 * both sizes, they hear PEER_REFUSED naming it, and nobody's memory changes.
 */
typedef spc_status_t (*op_fn)(spc_handle_t *h, spc_group_t g, uint8_t *send, uint8_t *recv, uint64_t need);

static void short_output(spc_handle_t *h, spc_group_t world, uint32_t p, uint32_t bad, const char *name, op_fn op,
                         uint64_t send_bytes, uint64_t need, uint64_t given, const char *tensor)
{
    char want[160];
    uint8_t *send = spc_alloc(h, send_bytes), *guard;
    CHECK(send != NULL);
    memset(send, 1, send_bytes);
    uint64_t have = p == bad ? given : need;
    uint8_t *recv = alloc_guarded(h, have, &guard);

    snprintf(want, sizeof want, "%s tensor holds %llu bytes; the op needs %llu", tensor, (unsigned long long)given,
             (unsigned long long)need);
    spc_status_t st = op(h, world, send, recv, need);
    if (p == bad) {
        if (st != SPC_ERR_INVALID_ARG)
            SP_FAIL("%s, output %llu bytes short: %s (%s), want SPC_ERR_INVALID_ARG", name,
                    (unsigned long long)(need - given), spc_status_name(st), spc_last_error(h));
        CHECK_CONTAINS(spc_last_error(h), want);
        printf("%s: %s\n", name, spc_last_error(h));
    } else {
        if (st != SPC_ERR_PEER_REFUSED)
            SP_FAIL("%s beside rank %u's short output: %s (%s), want SPC_ERR_PEER_REFUSED", name, bad,
                    spc_status_name(st), spc_last_error(h));
        char who[48];
        snprintf(who, sizeof who, "rank %u's request was refused: ", bad);
        CHECK_CONTAINS(spc_last_error(h), who);
        CHECK_CONTAINS(spc_last_error(h), want);
    }
    check_marked(recv, have, name);
    check_marked(guard, GUARD, name);
    spc_free(h, send);
    spc_free(h, recv);
    spc_free(h, guard);
}

static spc_status_t do_allreduce(spc_handle_t *h, spc_group_t g, uint8_t *send, uint8_t *recv, uint64_t need)
{
    return spc_allreduce(h, g, send, recv, need / sizeof(float), SPC_F32, SPC_SUM, WAIT_MS);
}

static spc_status_t do_allgather(spc_handle_t *h, spc_group_t g, uint8_t *send, uint8_t *recv, uint64_t need)
{
    return spc_allgather(h, g, send, recv, need / P / sizeof(float), SPC_F32, WAIT_MS);
}

/* Rank 0 broadcasts its `recv`, which it marked like everyone else's. */
static spc_status_t do_broadcast(spc_handle_t *h, spc_group_t g, uint8_t *send, uint8_t *recv, uint64_t need)
{
    (void)send;
    return spc_broadcast(h, g, recv, need / sizeof(float), SPC_F32, 0, WAIT_MS);
}

static spc_status_t do_shift(spc_handle_t *h, spc_group_t g, uint8_t *send, uint8_t *recv, uint64_t need)
{
    spc_shift_desc_t d = { .struct_size = sizeof d, .group = g, .ntensors = 1 };
    d.tensors[0].send = send;
    d.tensors[0].recv = recv;
    d.tensors[0].bytes = need;
    return spc_shift(h, &d, WAIT_MS);
}

static void collectives(spc_handle_t *h, spc_group_t world, uint32_t p)
{
    short_output(h, world, p, 1, "allreduce", do_allreduce, 128, 128, 64, "receive");
    short_output(h, world, p, 2, "allgather", do_allgather, 64, 256, 192, "receive");
    short_output(h, world, p, 3, "broadcast", do_broadcast, 64, 128, 64, "broadcast");
    short_output(h, world, p, 0, "shift", do_shift, 128, 128, 64, "receive 0");
}

/* ================================================================ freed, raw */

/* A tensor in memory given back to the arena names nothing: refused at submit. */
static void freed(spc_handle_t *h, spc_group_t world)
{
    float *x = spc_alloc(h, 64);
    CHECK(x != NULL);
    spc_free(h, x);
    spc_request_t *r;
    CHECK_ST(h, spc_iallreduce(h, world, x, x, 16, SPC_F32, SPC_SUM, &r), SPC_ERR_BAD_REGION);
    CHECK_CONTAINS(spc_last_error(h), "tensor 0 at arena offset");
    CHECK_CONTAINS(spc_last_error(h), "is in no live allocation");
}

/* Publishes an all-reduce of `count` floats whose receive declares no length,
 * as a library other than libspclient might write it. Its completion names no
 * request: the reaper drops it. */
static void submit_raw(spc_handle_t *h, spc_group_t g, const void *send, void *recv, uint64_t count)
{
    uint32_t idx = h->sq_tail & h->sq_mask;
    h->v.sqes[idx] = (struct sp_sqe){ .opcode = SP_OP_ALLREDUCE, .dtype = SP_DTYPE_F32, .redop = SP_REDOP_SUM,
                                      .ntensors = 2, .group = g, .user_data = UINT64_MAX, .count = count };
    sp_seg_slot_tensor(&h->v, idx)[0] = (struct sp_tensor_ref){
        .region = SP_REGION_ARENA, .dtype = SP_DTYPE_F32, .offset = (uint64_t)((const uint8_t *)send - h->v.arena),
        .bytes = count * sizeof(float) };
    sp_seg_slot_tensor(&h->v, idx)[1] = (struct sp_tensor_ref){
        .region = SP_REGION_ARENA, .dtype = SP_DTYPE_F32, .offset = (uint64_t)((uint8_t *)recv - h->v.arena),
        .bytes = 0 };
    h->sq_tail++;
    sp_store_release(&h->v.sq->tail, h->sq_tail);
    sp_smp_mb();
    spc__wake_daemon(h);
}

static void raw(spc_handle_t *h, spc_group_t world, uint32_t p)
{
    enum { COUNT = 32 };
    float *send = spc_alloc(h, COUNT * sizeof(float));
    CHECK(send != NULL);
    for (int i = 0; i < COUNT; i++)
        send[i] = 1.0f;
    uint8_t *guard;
    float *recv = alloc_guarded(h, p == 0 ? 64 : COUNT * sizeof(float), &guard);
    if (p == 0) {
        submit_raw(h, world, send, recv, COUNT);
    } else {
        CHECK_ST(h, spc_allreduce(h, world, send, recv, COUNT, SPC_F32, SPC_SUM, WAIT_MS), SPC_ERR_PEER_REFUSED);
        CHECK_CONTAINS(spc_last_error(h), "rank 0's request was refused: receive tensor holds 0 bytes; the op "
                       "needs 128");
        if (p == 1)
            printf("beside a receive that declares no length: %s\n", spc_last_error(h));
    }
    /* Ops of a group run in order: once the barrier is through, so is the raw op. */
    CHECK_OK(h, spc_barrier(h, world, WAIT_MS));
    check_marked(recv, p == 0 ? 64 : COUNT * sizeof(float), "the raw op's receive");
    check_marked(guard, GUARD, "the allocation after the raw op's receive");
}

/* ================================================================ main */

static int rank_main(spc_handle_t *h, spc_group_t world, int rank, int nranks, void *arg)
{
    (void)arg;
    CHECK_EQ(nranks, P);
    uint32_t p = (uint32_t)rank;
    ulysses(h, world, p);
    padded_rows(h, world);
    collectives(h, world, p);
    freed(h, world);
    raw(h, world, p);
    /* The group is still good. */
    float *x = spc_alloc(h, sizeof *x);
    *x = (float)(rank + 1);
    CHECK_OK(h, spc_allreduce(h, world, x, x, 1, SPC_F32, SPC_SUM, WAIT_MS));
    CHECK_EQ(*x, 10.0f);
    return 0;
}

int main(void)
{
    char out[64];
    sp_test_daemon_start(&daemon_, NULL);
    sp_test_run_job(P, rank_main, NULL);
    sp_test_daemon_serves();
    /* Each refusal is in spd's log, with the tensor and both sizes. */
    CHECK_EQ(sp_test_run(out, sizeof out, "grep -c \"request was refused: alltoall receive 0 tensor holds 128 "
                         "bytes; the op needs 256\" %s", daemon_.log), 0);
    CHECK(atoi(out) >= 2);
    CHECK_EQ(sp_test_run(out, sizeof out, "grep -c \"rank 0's request was refused: receive tensor holds 0 bytes\" %s",
                         daemon_.log), 0);
    CHECK_EQ(sp_test_daemon_stop(&daemon_), 0);
    sp_test_daemon_cleanup(&daemon_);
    printf("ok\n");
    return 0;
}
