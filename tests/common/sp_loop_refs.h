/*
 * sp_loop_refs.h — the loops that run through a restart
 * (tests/integration/test_restart.c, test_peer_relink.c,
 * test_nccl_relink_stub.c): each rank's inputs as a function of the
 * iteration, the all-to-all (seq->head) they run, and its results and the
 * all-reduces' checked against references computed here. The includer
 * defines the shapes: P ranks, SL rows per rank (S in all), H heads (HL per
 * rank after the all-to-all), D dims per head, N doubles per all-reduce.
 */
#ifndef SP_LOOP_REFS_H
#define SP_LOOP_REFS_H

#include "sp_test.h"

/* Integers in doubles: every sum below is exact, in any order. */
static double val(int it, int rank, int i, int salt)
{
    return (double)(((unsigned)it * 131u + (unsigned)rank * 17u + (unsigned)i * 7u + (unsigned)salt * 1009u) % 1000u);
}

/* The all-to-all's input of rank q: [1, SL, H, D] (BSHD), row lr, head h. */
static double a2a_in(int it, int q, int lr, int h, int dd)
{
    return val(it, q, (lr * H + h) * D + dd, 3);
}

/* Rank `rank`'s all-to-all input at iteration it, into send. */
static void a2a_fill(int it, int rank, double *send)
{
    for (int lr = 0; lr < SL; lr++)
        for (int h = 0; h < H; h++)
            for (int dd = 0; dd < D; dd++)
                send[(lr * H + h) * D + dd] = a2a_in(it, rank, lr, h, dd);
}

/* The all-to-all whose result check_a2a checks: send (seq) to recv (head) over group. */
static spc_alltoall_desc_t a2a_desc(spc_group_t group, double *send, double *recv)
{
    spc_alltoall_desc_t a = SPC_ALLTOALL_DESC_INIT;
    a.group = group;
    a.dtype = SPC_F64;
    a.direction = SPC_SEQ_TO_HEAD;
    a.layout = SPC_LAYOUT_BSHD;
    a.batch = 1;
    a.seq_len = S;
    a.ntensors = 1;
    a.tensors[0] = (spc_a2a_tensor_t){ .send = send, .recv = recv, .heads = H, .head_dim = D };
    return a;
}

static void check_a2a(int it, int rank, const double *out)
{
    for (int row = 0; row < S; row++)
        for (int k = 0; k < HL; k++)
            for (int dd = 0; dd < D; dd++) {
                double want = a2a_in(it, row / SL, row % SL, rank * HL + k, dd);
                double got = out[(row * HL + k) * D + dd];
                if (got != want)
                    SP_FAIL("iter %d rank %d: all-to-all row %d head %d dim %d is %g, expected %g", it, rank, row, k,
                            dd, got, want);
            }
}

/* x, the sum over the world of every rank's val(it, rank, i, salt). */
static void check_sum(int it, int rank, const double *x, int salt, const char *what)
{
    for (int i = 0; i < N; i++) {
        double want = 0;
        for (int r = 0; r < P; r++)
            want += val(it, r, i, salt);
        if (x[i] != want)
            SP_FAIL("iter %d rank %d: %s [%d] is %g, expected %g", it, rank, what, i, x[i], want);
    }
}

#endif /* SP_LOOP_REFS_H */
