/*
 * spctl stats and the flight recorder (spctl ops --history) against a real spd
 * and two rank processes: the counts, failures and bytes match the ops the
 * ranks ran (bytes worked out here from the shapes, not read back from spd);
 * a timed-out op is in the history with its missing rank named; the recorder
 * keeps only the last op_history ops; the record of a job outlives the job.
 */
#include <unistd.h>

#include "sp_test.h"

#define P        2
#define AR_COUNT 1000      /* fp32 allreduce elements */
#define AG_COUNT 100       /* fp32 allgather elements per rank */
#define BC_COUNT 50        /* fp32 broadcast elements */
#define SH_BYTES 1024      /* shift bytes per rank, on channel 1 */
#define A2A_S    8         /* alltoall: B 1, S 8, H 4, D 16, fp32, seq->head */
#define A2A_H    4
#define A2A_D    16
#define HISTORY  8         /* op_history of this spd */

/* Bytes each op writes over the group, from its shape. */
#define AR_BYTES  ((uint64_t)AR_COUNT * 4 * P)
#define AG_BYTES  ((uint64_t)AG_COUNT * 4 * P * P)
#define BC_BYTES  ((uint64_t)BC_COUNT * 4 * (P - 1))
#define SH_TOTAL  ((uint64_t)SH_BYTES * P)
#define A2A_BYTES ((uint64_t)A2A_S * (A2A_H / P) * A2A_D * 4 * P)

static int to1[2], to0[2];   /* rank 0 -> rank 1: "your late op may come now"; back: "done" */
static char out[1 << 18], rec[8192];

static spc_status_t allreduce(spc_handle_t *h, spc_group_t g, float *x, uint64_t count, uint32_t timeout_ms)
{
    spc_op_t op = { .struct_size = sizeof op, .opcode = SPC_OP_ALLREDUCE, .group = g, .dtype = SPC_F32,
                    .redop = SPC_SUM, .count = count, .ntensors = 2, .timeout_ms = timeout_ms };
    op.tensors[0].ptr = x;
    op.tensors[1].ptr = x;
    return sp_test_submit_wait(h, &op, 30000);
}

/* The record of `op` on group g of the stats JSON (scope "group"), or of the daemon (g < 0). */
static void stats_record(const char *json, const char *job, long g, const char *op)
{
    char needle[512];
    if (g < 0)
        snprintf(needle, sizeof needle, "\"scope\":\"daemon\",\"job\":\"\",\"group\":-1,\"kind\":\"\",\"size\":0,"
                 "\"op\":\"%s\"", op);
    else
        snprintf(needle, sizeof needle, "\"scope\":\"group\",\"job\":\"%s\",\"group\":%ld,\"kind\":\"world\","
                 "\"size\":%d,\"op\":\"%s\"", job, g, P, op);
    if (!sp_test_json_record(json, json, needle, rec, sizeof rec))
        SP_FAIL("no record %s in %s", needle, json);
}

static void check_counts(const char *op, long long ops, long long failed, long long bytes, const char *failures)
{
    char got[256];
    CHECK_EQ(sp_test_json_int(rec, "ops"), ops);
    CHECK_EQ(sp_test_json_int(rec, "failed"), failed);
    CHECK_EQ(sp_test_json_int(rec, "bytes"), bytes);
    sp_test_json_str(rec, "failures", got, sizeof got);
    if (strcmp(got, failures) != 0)
        SP_FAIL("%s failures: \"%s\" != \"%s\"", op, got, failures);
    double p50 = sp_test_json_double(rec, "p50_us"), p99 = sp_test_json_double(rec, "p99_us");
    double max = sp_test_json_double(rec, "max_us");
    if (strcmp(op, "noop") == 0) {
        CHECK(p50 == 0 && max == 0);   /* ends where it was taken: counted as 0 (stats.h) */
    } else if (ops > failed) {
        /* Durations: positive, ordered, the max a real one. */
        CHECK(p50 > 0 && p50 <= p99 && p99 <= max && max < 60e6);
    }
}

/* What rank 0 checks while the job is alive. */
static void check_while_alive(spc_group_t world)
{
    const char *spctl = sp_test_spctl_bin();
    char job[SPC_JOB_ID_MAX + 8];

    CHECK_EQ(sp_test_run(out, sizeof out, "%s --json jobs", spctl), 0);
    sp_test_json_str(out, "id", job, sizeof job);   /* the only job */

    CHECK_EQ(sp_test_run(out, sizeof out, "%s --json stats %s", spctl, job), 0);
    stats_record(out, job, world, "allreduce");
    /* 3 fine, one mismatch (counted once for both ranks), one timeout (once, the
     * late rank's error not again). */
    check_counts("allreduce", 5, 2, 3 * AR_BYTES, "SPC_ERR_MISMATCH:1 SPC_ERR_TIMEOUT:1");
    stats_record(out, job, world, "allgather");
    check_counts("allgather", 2, 0, 2 * AG_BYTES, "");
    stats_record(out, job, world, "broadcast");
    check_counts("broadcast", 1, 0, BC_BYTES, "");
    stats_record(out, job, world, "barrier");
    check_counts("barrier", 1, 0, 0, "");
    stats_record(out, job, world, "shift");
    check_counts("shift", 1, 0, SH_TOTAL, "");
    stats_record(out, job, world, "alltoall");
    check_counts("alltoall", 1, 0, A2A_BYTES, "");
    /* A job filter shows no daemon-wide rows. */
    CHECK(strstr(out, "\"scope\":\"daemon\"") == NULL);

    /* Daemon-wide: the same, plus what never reached the group: every rank's
     * no-ops, and rank 0's op on a group it is not in. */
    CHECK_EQ(sp_test_run(out, sizeof out, "%s --json stats", spctl), 0);
    stats_record(out, NULL, -1, "noop");
    check_counts("noop", 2 * 3, 0, 0, "");
    stats_record(out, NULL, -1, "allreduce");
    check_counts("allreduce", 6, 3, 3 * AR_BYTES, "SPC_ERR_INVALID_ARG:1 SPC_ERR_MISMATCH:1 SPC_ERR_TIMEOUT:1");
    stats_record(out, NULL, -1, "alltoall");
    check_counts("alltoall", 1, 0, A2A_BYTES, "");

    /* Text. */
    CHECK_EQ(sp_test_run(out, sizeof out, "%s stats %s", spctl, job), 0);
    CHECK_CONTAINS(out, "OP         GROUP  KIND");
    CHECK_CONTAINS(out, "failed: SPC_ERR_MISMATCH:1 SPC_ERR_TIMEOUT:1");

    /* The flight recorder keeps the last HISTORY of the 11 collectives: seqs 3..9
     * on channel 0 and the shift on channel 1 (it ended after seq 7); the last is
     * the timeout. */
    CHECK_EQ(sp_test_run(out, sizeof out, "%s --json ops --history %s", spctl, job), 0);
    CHECK(strncmp(out, "{\"history\":[", 12) == 0);
    CHECK_CONTAINS(out, "],\"in_flight\":[");
    int n = 0;
    const char *in_flight = strstr(out, "],\"in_flight\":[");
    for (const char *p = out; (p = strstr(p, "\"channel\":")) != NULL && p < in_flight; p++)
        n++;
    CHECK_EQ(n, HISTORY);
    CHECK(!sp_test_json_record(out, out, "\"channel\":0,\"seq\":2,", rec, sizeof rec));
    CHECK(sp_test_json_record(out, out, "\"channel\":0,\"seq\":3,", rec, sizeof rec));
    CHECK(sp_test_json_record(out, out, "\"channel\":1,\"seq\":0,", rec, sizeof rec));
    CHECK_EQ(sp_test_json_int(rec, "bytes"), SH_TOTAL);
    char s[256];
    sp_test_json_str(rec, "op", s, sizeof s);
    CHECK_STREQ(s, "shift");
    sp_test_json_str(rec, "missing_ranks", s, sizeof s);
    CHECK_STREQ(s, "-");
    CHECK(sp_test_json_double(rec, "total_us") > 0);
    CHECK(sp_test_json_double(rec, "run_us") >= 0);   /* a copy ran: its phases are there */
    CHECK(sp_test_json_double(rec, "queue_us") >= 0);

    CHECK(sp_test_json_record(out, out, "\"channel\":0,\"seq\":8,", rec, sizeof rec));
    sp_test_json_str(rec, "status", s, sizeof s);
    CHECK_STREQ(s, "SPC_ERR_MISMATCH");
    sp_test_json_str(rec, "detail", s, sizeof s);
    CHECK_CONTAINS(s, "count");
    CHECK(sp_test_json_double(rec, "run_us") < 0);    /* refused before any byte moved */

    CHECK(sp_test_json_record(out, out, "\"channel\":0,\"seq\":9,", rec, sizeof rec));
    sp_test_json_str(rec, "status", s, sizeof s);
    CHECK_STREQ(s, "SPC_ERR_TIMEOUT");
    CHECK_EQ(sp_test_json_int(rec, "arrived"), 1);
    CHECK_EQ(sp_test_json_int(rec, "missing"), 1);
    sp_test_json_str(rec, "missing_ranks", s, sizeof s);
    CHECK_STREQ(s, "1");
    sp_test_json_str(rec, "first_rank", s, sizeof s);
    CHECK_STREQ(s, "0");
    sp_test_json_str(rec, "detail", s, sizeof s);
    CHECK_CONTAINS(s, "timed out waiting for rank 1 (1 of 2 missing) in allreduce #9");
    CHECK(sp_test_json_double(rec, "total_us") >= 200e3);   /* its timeout */

    /* In flight: rank 1's last barrier, waiting for rank 0. */
    bool pending = false;
    for (uint64_t end = sp_test_now_ms() + 10000; !pending && sp_test_now_ms() < end;) {
        CHECK_EQ(sp_test_run(out, sizeof out, "%s --json ops --history %s", spctl, job), 0);
        pending = sp_test_json_record(out, strstr(out, "\"in_flight\":"), "\"op\":\"barrier\"", rec, sizeof rec);
        if (!pending)
            usleep(2000);
    }
    CHECK(pending);
    sp_test_json_str(rec, "missing_ranks", s, sizeof s);
    CHECK_STREQ(s, "0");

    CHECK_EQ(sp_test_run(out, sizeof out, "%s ops --history %s", spctl, job), 0);
    CHECK_CONTAINS(out, "group ");
    CHECK_CONTAINS(out, "SPC_ERR_TIMEOUT");
    CHECK_CONTAINS(out, "      missing: 1\n");
    CHECK_CONTAINS(out, "      timed out waiting for rank 1");
    CHECK_CONTAINS(out, "in flight:\n");
    CHECK_CONTAINS(out, "barrier #10, 1 of 2 arrived");
}

static int rank_main(spc_handle_t *h, spc_group_t world, int rank, int nranks, void *arg)
{
    (void)nranks;
    (void)arg;
    char c = 'x';
    float *x = spc_alloc(h, AR_COUNT * sizeof *x);
    float *ag = spc_alloc(h, AG_COUNT * P * sizeof *ag);
    uint8_t *sh = spc_alloc(h, 2 * SH_BYTES);
    float *q = spc_alloc(h, 2 * (size_t)A2A_S * A2A_H * A2A_D * sizeof *q);
    CHECK(x != NULL && ag != NULL && sh != NULL && q != NULL);
    memset(x, 0, AR_COUNT * sizeof *x);
    memset(q, 0, 2 * (size_t)A2A_S * A2A_H * A2A_D * sizeof *q);

    for (int i = 0; i < 3; i++) {
        CHECK_OK(h, spc_noop(h, 10000));
        CHECK_OK(h, allreduce(h, world, x, AR_COUNT, 0));                       /* seq 0 .. 2 */
    }
    for (int i = 0; i < 2; i++)
        CHECK_OK(h, spc_allgather(h, world, x, ag, AG_COUNT, SPC_F32, 10000));  /* 3, 4 */
    CHECK_OK(h, spc_broadcast(h, world, x, BC_COUNT, SPC_F32, 0, 10000));       /* 5 */
    CHECK_OK(h, spc_barrier(h, world, 10000));                                  /* 6 */
    spc_alltoall_desc_t a = { .struct_size = sizeof a, .group = world, .dtype = SPC_F32,
                              .direction = SPC_SEQ_TO_HEAD, .layout = SPC_LAYOUT_BSHD, .batch = 1,
                              .seq_len = A2A_S, .ntensors = 1 };
    a.tensors[0] = (spc_a2a_tensor_t){ .send = q, .recv = q + (size_t)A2A_S / P * A2A_H * A2A_D,
                                       .heads = A2A_H, .head_dim = A2A_D, .kind = SPC_HEADS_Q };
    CHECK_OK(h, spc_alltoall(h, &a, 10000));                                    /* 7 */
    spc_shift_desc_t s = { .struct_size = sizeof s, .group = world, .channel = 1, .ntensors = 1 };
    s.tensors[0].send = sh;
    s.tensors[0].recv = sh + SH_BYTES;
    s.tensors[0].bytes = SH_BYTES;
    CHECK_OK(h, spc_shift(h, &s, 10000));                                       /* channel 1, 0 */
    /* Ranks that disagree: one failure, counted once. */
    CHECK_ST(h, allreduce(h, world, x, rank == 0 ? 10 : 20, 0), SPC_ERR_MISMATCH); /* 8 */
    if (rank == 0) {
        /* Not a member of group 9999: refused before any group, counted daemon-wide. */
        CHECK_ST(h, allreduce(h, 9999, x, 1, 0), SPC_ERR_INVALID_ARG);
        CHECK_ST(h, allreduce(h, world, x, AR_COUNT, 200), SPC_ERR_TIMEOUT);    /* 9, rank 1 missing */
        CHECK(write(to1[1], &c, 1) == 1);
        CHECK(read(to0[0], &c, 1) == 1);   /* rank 1 collected its error */
        check_while_alive(world);
    } else {
        CHECK(read(to1[0], &c, 1) == 1);
        CHECK_ST(h, allreduce(h, world, x, AR_COUNT, 0), SPC_ERR_TIMEOUT);      /* 9, late */
        CHECK(write(to0[1], &c, 1) == 1);
    }
    CHECK_OK(h, spc_barrier(h, world, 30000));                                  /* 10 */
    return 0;
}

int main(void)
{
    char hist[] = "--set", histv[32];
    snprintf(histv, sizeof histv, "op_history=%d", HISTORY);
    const char *args[] = { hist, histv, NULL };
    sp_test_daemon_t d;
    sp_test_daemon_start(&d, args);
    const char *spctl = sp_test_spctl_bin();

    CHECK_EQ(sp_test_run(out, sizeof out, "%s stats", spctl), 0);
    CHECK_CONTAINS(out, "(no ops yet)");
    CHECK_EQ(sp_test_run(out, sizeof out, "%s ops --history", spctl), 0);
    CHECK_CONTAINS(out, "(no ops recorded)");
    CHECK_EQ(sp_test_run(out, sizeof out, "%s stats no-such-job 2>&1", spctl), 1);
    CHECK_CONTAINS(out, "SPC_ERR_NOT_FOUND");

    CHECK(pipe(to1) == 0 && pipe(to0) == 0);
    sp_test_run_job(P, rank_main, NULL);

    /* The job ended with its ranks: its groups are gone from stats (the
     * daemon-wide counts stay), their records stay readable. */
    CHECK_EQ(sp_test_run(out, sizeof out, "%s --json stats", spctl), 0);
    CHECK(strstr(out, "\"scope\":\"group\"") == NULL);
    stats_record(out, NULL, -1, "barrier");
    check_counts("barrier", 2, 0, 0, "");
    CHECK_EQ(sp_test_run(out, sizeof out, "%s --json ops --history", spctl), 0);
    CHECK(sp_test_json_record(out, out, "\"channel\":0,\"seq\":10,", rec, sizeof rec));
    CHECK_EQ(sp_test_json_int(rec, "job_ended"), 1);
    CHECK_EQ(sp_test_run(out, sizeof out, "%s ops --history", spctl), 0);
    CHECK_CONTAINS(out, " (ended) group ");

    CHECK_EQ(sp_test_daemon_stop(&d), 0);
    sp_test_daemon_cleanup(&d);
    printf("stats: ok\n");
    return 0;
}
