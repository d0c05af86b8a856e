/*
 * Ring shift across real ranks, checked against the contract in spclient.h:
 *
 *   1. cyclic and linear, forward and reverse, on groups of 2, 3 and 4 ranks, one
 *      op carrying several tensors of different sizes (1 byte to 64 KiB + 13),
 *      through spc_shift and spc_ishift, on each of the channels; the received
 *      bytes are checked one by one against the neighbour's data, which every
 *      process computes itself from the rank number, and the bytes after each
 *      receive extent and the send buffers must be left alone;
 *   2. several shifts in flight on one channel, waited for out of order;
 *   3. the four streams of a training step at once, one per channel, double
 *      buffered over 2P + 1 steps: KV forward, dKV reverse, a linear halo and a
 *      linear reverse state. Each step submits the next rotation of every stream
 *      before "computing" on (checking) the current buffers; even ranks submit KV
 *      first, odd ranks dKV first, and they wait in other orders again;
 *   4. misuse: a rank passing another size makes every rank fail with
 *      SPC_ERR_MISMATCH naming the rank and field, nothing is written, a valid
 *      shift on another channel in flight at the same time is unaffected, and the
 *      group and channel work for the next shift. Bad channels and tensor counts
 *      are refused with SPC_ERR_INVALID_ARG.
 */
#include "sp_test.h"

#define SLACK  64      /* canary bytes after each receive extent */
#define CANARY 0xA5
#define WAIT_MS 10000

/* ------------------------------------------------------------------ data */

/* Byte j of tensor `tensor` of stream `stream` as rank `origin` first fills it.
 * A hash, so that a byte from the wrong rank, tensor, stream or offset shows. */
static uint8_t fill_byte(int origin, uint32_t stream, uint32_t tensor, uint64_t j)
{
    uint64_t x = (uint64_t)(origin + 1) * 0x9E3779B97F4A7C15ull ^ (uint64_t)(stream + 1) * 0xBF58476D1CE4E5B9ull ^
                 (uint64_t)(tensor + 1) * 0x94D049BB133111EBull ^ (j + 1) * 0xD6E8FEB86659FD93ull;
    x ^= x >> 31;
    x *= 0xD6E8FEB86659FD93ull;
    x ^= x >> 29;
    return (uint8_t)(x >> 24);
}

static void fill(uint8_t *buf, uint64_t bytes, int origin, uint32_t stream, uint32_t tensor)
{
    for (uint64_t j = 0; j < bytes; j++)
        buf[j] = fill_byte(origin, stream, tensor, j);
}

/* A receive buffer before the op: canaries everywhere, extent and slack. */
static void poison(uint8_t *buf, uint64_t bytes)
{
    memset(buf, CANARY, bytes + SLACK);
}

/*
 * Checks that buf holds the `bytes` bytes rank `origin` filled (origin < 0: zeros)
 * followed by SLACK canaries; fails with the first wrong byte otherwise. `what`
 * says where we are, for the message.
 */
static void expect(const uint8_t *buf, uint64_t bytes, int origin, uint32_t stream, uint32_t tensor,
                   const char *what)
{
    for (uint64_t j = 0; j < bytes; j++) {
        uint8_t want = origin < 0 ? 0 : fill_byte(origin, stream, tensor, j);
        if (buf[j] != want) {
            uint64_t bad = 0;
            for (uint64_t k = j; k < bytes; k++)
                bad += buf[k] != (origin < 0 ? 0 : fill_byte(origin, stream, tensor, k));
            SP_FAIL("%s: tensor %u (%llu bytes): byte %llu is 0x%02x, expected 0x%02x from %s %d "
                    "(%llu bytes differ)",
                    what, tensor, (unsigned long long)bytes, (unsigned long long)j, buf[j], want,
                    origin < 0 ? "zeros, not rank" : "rank", origin, (unsigned long long)bad);
        }
    }
    for (uint64_t j = bytes; j < bytes + SLACK; j++)
        if (buf[j] != CANARY)
            SP_FAIL("%s: tensor %u (%llu bytes): byte %llu past the extent was overwritten (0x%02x)", what,
                    tensor, (unsigned long long)bytes, (unsigned long long)j, buf[j]);
}

/* The rank whose data group rank p holds after `steps` shifts with `flags`, or -1
 * for zeros (a linear shift's first rank, and whatever it passed on). */
static int origin_after(int p, int steps, int P, uint32_t flags)
{
    int o = flags & SPC_SHIFT_REVERSE ? p + steps : p - steps;
    if (flags & SPC_SHIFT_LINEAR)
        return o < 0 || o >= P ? -1 : o;
    return ((o % P) + P) % P;
}

static const char *flags_name(uint32_t flags)
{
    static const char *const names[] = { "cyclic", "linear", "cyclic reverse", "linear reverse" };
    return names[flags & 3];
}

static void *must_alloc(spc_handle_t *h, uint64_t bytes)
{
    void *p = spc_alloc(h, bytes);
    if (p == NULL)
        SP_FAIL("spc_alloc(%llu) returned NULL", (unsigned long long)bytes);
    return p;
}

/* ------------------------------------------------------------------ 1, 2: every mode */

static const uint64_t mode_sizes[4] = { 1, 4099, 64, 65536 + 13 };

/* One op per mode, four tensors of different sizes, on channel = mode; the
 * blocking call for two modes, submit and wait for the other two. */
static int rank_modes(spc_handle_t *h, spc_group_t world, int rank, int P, void *arg)
{
    uint8_t *send[4], *recv[4];
    for (uint32_t i = 0; i < 4; i++) {
        send[i] = must_alloc(h, mode_sizes[i]);
        recv[i] = must_alloc(h, mode_sizes[i] + SLACK);
    }
    for (uint32_t mode = 0; mode < 4; mode++) {
        uint32_t flags = mode;   /* 0, LINEAR, REVERSE, LINEAR | REVERSE */
        spc_shift_desc_t d = { .struct_size = sizeof d, .group = world, .channel = mode, .flags = flags,
                               .ntensors = 4, .timeout_ms = WAIT_MS };
        for (uint32_t i = 0; i < 4; i++) {
            fill(send[i], mode_sizes[i], rank, mode, i);
            poison(recv[i], mode_sizes[i]);
            d.tensors[i].send = send[i];
            d.tensors[i].recv = recv[i];
            d.tensors[i].bytes = mode_sizes[i];
        }
        if (mode & 1) {
            spc_request_t *r;
            CHECK_OK(h, spc_ishift(h, &d, &r));
            spc_status_t st = spc_wait(r, WAIT_MS);
            if (st != SPC_OK)
                SP_FAIL("rank %d of %d, %s: spc_wait: %s (%s)", rank, P, flags_name(flags),
                        spc_status_name(st), spc_request_detail(r));
            spc_request_release(r);
        } else {
            CHECK_OK(h, spc_shift(h, &d, WAIT_MS));
        }
        char what[96];
        snprintf(what, sizeof what, "rank %d of %d, %s shift", rank, P, flags_name(flags));
        int from = origin_after(rank, 1, P, flags);
        for (uint32_t i = 0; i < 4; i++) {
            expect(recv[i], mode_sizes[i], from, mode, i, what);
            for (uint64_t j = 0; j < mode_sizes[i]; j++)
                if (send[i][j] != fill_byte(rank, mode, i, j))
                    SP_FAIL("%s: send tensor %u byte %llu was changed", what, i, (unsigned long long)j);
        }
    }

    /* Three shifts in flight on one channel, each with its own sizes, flags and
     * buffers; ranks match them by their order on the channel. Even ranks wait
     * newest first. */
    enum { NQ = 3 };
    static const uint64_t qsizes[NQ][2] = { { 100, 7 }, { 3, 2000 }, { 513, 511 } };
    static const uint32_t qflags[NQ] = { 0, SPC_SHIFT_REVERSE, SPC_SHIFT_LINEAR };
    uint8_t *qs[NQ][2], *qr[NQ][2];
    spc_request_t *req[NQ];
    for (uint32_t k = 0; k < NQ; k++) {
        spc_shift_desc_t d = { .struct_size = sizeof d, .group = world, .channel = 3, .flags = qflags[k],
                               .ntensors = 2, .timeout_ms = WAIT_MS };
        for (uint32_t i = 0; i < 2; i++) {
            qs[k][i] = must_alloc(h, qsizes[k][i]);
            qr[k][i] = must_alloc(h, qsizes[k][i] + SLACK);
            fill(qs[k][i], qsizes[k][i], rank, 10 + k, i);
            poison(qr[k][i], qsizes[k][i]);
            d.tensors[i].send = qs[k][i];
            d.tensors[i].recv = qr[k][i];
            d.tensors[i].bytes = qsizes[k][i];
        }
        CHECK_OK(h, spc_ishift(h, &d, &req[k]));
    }
    for (uint32_t n = 0; n < NQ; n++) {
        uint32_t k = rank % 2 == 0 ? NQ - 1 - n : n;
        spc_status_t st = spc_wait(req[k], WAIT_MS);
        if (st != SPC_OK)
            SP_FAIL("rank %d of %d, queued shift %u: %s (%s)", rank, P, k, spc_status_name(st),
                    spc_request_detail(req[k]));
        spc_request_release(req[k]);
    }
    for (uint32_t k = 0; k < NQ; k++) {
        char what[96];
        snprintf(what, sizeof what, "rank %d of %d, queued %s shift %u on one channel", rank, P,
                 flags_name(qflags[k]), k);
        for (uint32_t i = 0; i < 2; i++)
            expect(qr[k][i], qsizes[k][i], origin_after(rank, 1, P, qflags[k]), 10 + k, i, what);
    }
    CHECK_OK(h, spc_barrier(h, world, WAIT_MS));
    return 0;
}

/* ------------------------------------------------------------------ 3: streams */

enum { KV, DKV, HALO, STATE, NSTREAMS };

struct stream {
    const char    *name;
    uint32_t       channel, flags, ntensors;
    uint64_t       bytes[2];
    uint8_t       *buf[2][2];   /* [double buffer][tensor], each bytes + SLACK */
    spc_request_t *req;
};

/* Submission and wait orders: every rank a different pair, even ranks KV first,
 * odd ranks dKV first. */
static const int submit_order[2][NSTREAMS] = { { KV, DKV, HALO, STATE }, { DKV, STATE, KV, HALO } };
static const int wait_order[4][NSTREAMS] = {
    { STATE, HALO, DKV, KV },
    { KV, HALO, DKV, STATE },
    { DKV, KV, STATE, HALO },
    { HALO, STATE, KV, DKV },
};

static int rank_streams(spc_handle_t *h, spc_group_t world, int rank, int P, void *arg)
{
    struct stream st[NSTREAMS] = {
        [KV] = { "KV", 0, 0, 2, { 3000, 5003 } },
        [DKV] = { "dKV", 1, SPC_SHIFT_REVERSE, 2, { 2055, 777 } },
        [HALO] = { "halo", 2, SPC_SHIFT_LINEAR, 1, { 333, 0 } },
        [STATE] = { "state", 3, SPC_SHIFT_LINEAR | SPC_SHIFT_REVERSE, 2, { 8, 100 } },
    };
    for (int s = 0; s < NSTREAMS; s++)
        for (uint32_t i = 0; i < st[s].ntensors; i++) {
            for (int b = 0; b < 2; b++)
                st[s].buf[b][i] = must_alloc(h, st[s].bytes[i] + SLACK);
            fill(st[s].buf[0][i], st[s].bytes[i], rank, (uint32_t)s, i);
            memset(st[s].buf[0][i] + st[s].bytes[i], CANARY, SLACK);
        }

    const int steps = 2 * P + 1;   /* more than one full turn */
    for (int step = 0; step < steps; step++) {
        int cur = step % 2, nxt = 1 - cur;
        bool more = step + 1 < steps;

        /* Next rotation of every stream, in this rank's order, before computing. */
        for (int n = 0; more && n < NSTREAMS; n++) {
            struct stream *s = &st[submit_order[rank % 2][n]];
            spc_shift_desc_t d = { .struct_size = sizeof d, .group = world, .channel = s->channel,
                                   .flags = s->flags, .ntensors = s->ntensors, .timeout_ms = WAIT_MS };
            for (uint32_t i = 0; i < s->ntensors; i++) {
                poison(s->buf[nxt][i], s->bytes[i]);
                d.tensors[i].send = s->buf[cur][i];
                d.tensors[i].recv = s->buf[nxt][i];
                d.tensors[i].bytes = s->bytes[i];
            }
            CHECK_OK(h, spc_ishift(h, &d, &s->req));
        }

        /* "Compute" on the current buffers: they hold what `step` rotations bring. */
        for (int s = 0; s < NSTREAMS; s++) {
            char what[128];
            snprintf(what, sizeof what, "rank %d of %d, stream %s (%s, channel %u), step %d", rank, P,
                     st[s].name, flags_name(st[s].flags), st[s].channel, step);
            for (uint32_t i = 0; i < st[s].ntensors; i++)
                expect(st[s].buf[cur][i], st[s].bytes[i], origin_after(rank, step, P, st[s].flags), (uint32_t)s,
                       i, what);
        }

        for (int n = 0; more && n < NSTREAMS; n++) {
            struct stream *s = &st[wait_order[rank % 4][n]];
            spc_status_t rc = spc_wait(s->req, WAIT_MS);
            if (rc != SPC_OK)
                SP_FAIL("rank %d of %d, stream %s, step %d: %s (%s)", rank, P, s->name, step,
                        spc_status_name(rc), rc == SPC_IN_PROGRESS ? "still in flight" : spc_request_detail(s->req));
            spc_request_release(s->req);
            s->req = NULL;
        }
    }
    CHECK_OK(h, spc_barrier(h, world, WAIT_MS));
    return 0;
}

/* ------------------------------------------------------------------ 4: misuse */

struct mismatch_arg {
    int bad;   /* the rank that passes another size */
};

/* Fails unless detail names rank `bad` and the field that differs. */
static void expect_size_detail(const char *detail, int bad, const char *what)
{
    char r[32];
    snprintf(r, sizeof r, "rank %d", bad);
    if (strstr(detail, r) == NULL || (strstr(detail, "bytes") == NULL && strstr(detail, "size") == NULL))
        SP_FAIL("%s: detail \"%s\" does not name %s and the size", what, detail, r);
}

static int rank_mismatch(spc_handle_t *h, spc_group_t world, int rank, int P, void *arg)
{
    const struct mismatch_arg *a = arg;
    const uint64_t sz[2] = { 100, 200 };
    uint8_t *send[2], *recv[2], *send1[2], *recv1[2];
    for (uint32_t i = 0; i < 2; i++) {
        send[i] = must_alloc(h, sz[i] + 8);
        recv[i] = must_alloc(h, sz[i] + 8 + SLACK);
        send1[i] = must_alloc(h, sz[i] + 8);
        recv1[i] = must_alloc(h, sz[i] + 8 + SLACK);
    }
    spc_shift_desc_t d = { .struct_size = sizeof d, .group = world, .channel = 0, .ntensors = 2,
                           .timeout_ms = WAIT_MS };
    for (uint32_t i = 0; i < 2; i++) {
        fill(send[i], sz[i] + 8, rank, 0, i);
        poison(recv[i], sz[i] + 8);
        d.tensors[i].send = send[i];
        d.tensors[i].recv = recv[i];
        d.tensors[i].bytes = sz[i];
    }

    /* Refused arguments: a channel past the last, no tensors, too many. */
    spc_shift_desc_t x = d;
    x.channel = SPC_CHANNELS;
    CHECK_ST(h, spc_shift(h, &x, WAIT_MS), SPC_ERR_INVALID_ARG);
    x = d;
    x.ntensors = 0;
    CHECK_ST(h, spc_shift(h, &x, WAIT_MS), SPC_ERR_INVALID_ARG);
    x = d;
    x.ntensors = 5;
    CHECK_ST(h, spc_shift(h, &x, WAIT_MS), SPC_ERR_INVALID_ARG);

    /* Rank `bad` sends 8 bytes more of tensor 1: every rank hears it, nothing moves. */
    char what[96];
    snprintf(what, sizeof what, "rank %d of %d, size mismatch of rank %d", rank, P, a->bad);
    if (rank == a->bad)
        d.tensors[1].bytes += 8;
    CHECK_ST(h, spc_shift(h, &d, WAIT_MS), SPC_ERR_MISMATCH);
    expect_size_detail(spc_last_error(h), a->bad, what);
    if (rank == 0)
        printf("P=%d: rank %d's other size: \"%s\"\n", P, a->bad, spc_last_error(h));
    for (uint32_t i = 0; i < 2; i++)
        for (uint64_t j = 0; j < sz[i] + 8 + SLACK; j++)
            if (recv[i][j] != CANARY)
                SP_FAIL("%s: receive tensor %u byte %llu was written", what, i, (unsigned long long)j);
    d.tensors[1].bytes = sz[1];

    /* The same on channel 1 while a valid shift runs on channel 0: channel 0 is
     * unaffected. Rank 1 is the odd one this time. */
    spc_shift_desc_t good = d;
    for (uint32_t i = 0; i < 2; i++) {
        fill(send1[i], sz[i], rank, 1, i);
        poison(recv1[i], sz[i]);
        good.tensors[i].send = send1[i];
        good.tensors[i].recv = recv1[i];
    }
    spc_shift_desc_t bad = d;
    bad.channel = 1;
    if (rank == 1)
        bad.tensors[0].bytes -= 1;
    spc_request_t *rg, *rb;
    if (rank % 2) {
        CHECK_OK(h, spc_ishift(h, &bad, &rb));
        CHECK_OK(h, spc_ishift(h, &good, &rg));
    } else {
        CHECK_OK(h, spc_ishift(h, &good, &rg));
        CHECK_OK(h, spc_ishift(h, &bad, &rb));
    }
    snprintf(what, sizeof what, "rank %d of %d, channel 1 mismatch of rank 1", rank, P);
    spc_status_t st = spc_wait(rb, WAIT_MS);
    if (st != SPC_ERR_MISMATCH)
        SP_FAIL("%s: got %s, expected SPC_ERR_MISMATCH (%s)", what, spc_status_name(st), spc_request_detail(rb));
    expect_size_detail(spc_request_detail(rb), 1, what);
    spc_request_release(rb);
    st = spc_wait(rg, WAIT_MS);
    if (st != SPC_OK)
        SP_FAIL("rank %d of %d, valid shift on channel 0 beside the mismatch: %s (%s)", rank, P, spc_status_name(st),
                spc_request_detail(rg));
    spc_request_release(rg);
    snprintf(what, sizeof what, "rank %d of %d, valid shift on channel 0 beside a mismatch", rank, P);
    for (uint32_t i = 0; i < 2; i++)
        expect(recv1[i], sz[i], origin_after(rank, 1, P, 0), 1, i, what);

    /* Both channels go on: the next shifts match and move the data. */
    for (uint32_t ch = 0; ch < 2; ch++) {
        spc_shift_desc_t ok = d;
        ok.channel = ch;
        ok.flags = ch ? SPC_SHIFT_REVERSE : 0;
        for (uint32_t i = 0; i < 2; i++)
            poison(recv[i], sz[i]);
        CHECK_OK(h, spc_shift(h, &ok, WAIT_MS));
        snprintf(what, sizeof what, "rank %d of %d, shift on channel %u after the mismatches", rank, P, ch);
        for (uint32_t i = 0; i < 2; i++)
            expect(recv[i], sz[i], origin_after(rank, 1, P, ok.flags), 0, i, what);
    }
    CHECK_OK(h, spc_barrier(h, world, WAIT_MS));
    return 0;
}

/* ------------------------------------------------------------------ main */

int main(int argc, char **argv)
{
    sp_test_daemon_t d;
    sp_test_start(&d, argc, argv);

    for (int P = 2; P <= 4; P++) {
        uint64_t t0 = sp_test_now_ms();
        sp_test_run_job(P, rank_modes, NULL);
        uint64_t t1 = sp_test_now_ms();
        sp_test_run_job(P, rank_streams, NULL);
        uint64_t t2 = sp_test_now_ms();
        printf("P=%d: modes %llu ms, %d steps of 4 streams %llu ms\n", P, (unsigned long long)(t1 - t0),
               2 * P + 1, (unsigned long long)(t2 - t1));
    }
    for (int P = 3; P <= 4; P++) {
        struct mismatch_arg a = { .bad = P - 1 };
        sp_test_run_job(P, rank_mismatch, &a);
        printf("P=%d: mismatch ok\n", P);
    }

    CHECK_EQ(sp_test_cluster_stop(), 0);
    CHECK_EQ(sp_test_daemon_stop(&d), 0);
    sp_test_daemon_cleanup(&d);
    printf("shift: ok\n");
    return 0;
}
