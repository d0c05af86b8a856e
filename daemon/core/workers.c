/*
 * workers.c — copy helpers: threads that share the chunks of one large task with
 * the progress thread.
 *
 * sp_parallel_for publishes a job (a chunk count and a function), wakes the
 * helpers, and claims chunks itself with the same atomic counter they use. It
 * returns when every chunk is done and no helper still looks at the job, which
 * lives on its stack. A helper that finds nothing spins a little (back-to-back
 * tasks are common: a ring step follows a ring step) and then sleeps on a futex.
 *
 * Why not a queue of tasks for the helpers to run on their own: ops on a group
 * must execute in order (a rank may submit a shift that reads what the previous
 * all-to-all wrote), so one task at a time, with every thread on its chunks, is
 * both the simplest order and the fastest for the one task that matters.
 */
#include "core/engine.h"
#include "core/workers.h"

#include <errno.h>
#include <inttypes.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "base/log.h"
#include "sp_futex.h"

#define HELPER_SPIN_NS 20000   /* a helper polls this long for the next job before sleeping */

typedef struct par_job {
    uint32_t         n;
    sp_par_fn        fn;
    void            *arg;
    _Atomic uint32_t next;      /* next chunk to claim */
    _Atomic uint32_t done;      /* chunks finished */
    uint32_t         helpers;   /* how many helpers may join */
    _Atomic uint32_t joined;
} par_job_t;

struct sp_workers {
    pthread_t              *threads;
    uint32_t                n;
    _Atomic uint32_t        gen;      /* bumped per job; helpers sleep on it */
    _Atomic uint32_t        sleepers; /* helpers asleep (or about to be) on gen */
    _Atomic bool            stop;
    par_job_t *_Atomic      cur;      /* the job being shared, or NULL */
    _Atomic uint32_t        active;   /* helpers that may be looking at cur */
};

/* Claims and runs chunks of j until none is left. */
static void par_drain(par_job_t *j)
{
    for (;;) {
        uint32_t i = atomic_fetch_add_explicit(&j->next, 1, memory_order_relaxed);
        if (i >= j->n)
            return;
        j->fn(j->arg, i);
        /* Release: the chunk's writes are visible to whoever sees it counted. */
        atomic_fetch_add_explicit(&j->done, 1, memory_order_release);
    }
}

static void *helper_main(void *arg)
{
    struct sp_workers *w = arg;
    uint32_t seen = atomic_load(&w->gen);

    while (!atomic_load_explicit(&w->stop, memory_order_relaxed)) {
        /* Announce ourselves before looking at cur: sp_parallel_for clears cur and
         * then waits for active to drop to zero, so it never frees a job we hold. */
        atomic_fetch_add(&w->active, 1);
        par_job_t *j = atomic_load(&w->cur);
        if (j != NULL && atomic_fetch_add(&j->joined, 1) < j->helpers)
            par_drain(j);
        atomic_fetch_sub(&w->active, 1);

        uint64_t until = sp_now_ns() + HELPER_SPIN_NS;
        uint32_t g;
        while ((g = atomic_load(&w->gen)) == seen && sp_now_ns() < until)
            sp_cpu_relax();
        if (g == seen) {
            /* Say we sleep, then look again (full barrier between): either the
             * publisher sees us counted, or we see its new generation. */
            atomic_fetch_add(&w->sleepers, 1);
            if (atomic_load(&w->gen) == seen)
                sp_futex_wait(&w->gen, seen, 100 * 1000000LL);
            atomic_fetch_sub(&w->sleepers, 1);
        }
        seen = atomic_load(&w->gen);
    }
    return NULL;
}

void sp_parallel_for(sp_engine_t *eng, uint32_t n, uint32_t helpers, sp_par_fn fn, void *arg)
{
    struct sp_workers *w = eng->workers;
    if (w == NULL || w->n == 0 || n < 2 || helpers == 0) {
        for (uint32_t i = 0; i < n; i++)
            fn(arg, i);
        return;
    }
    par_job_t j = { .n = n, .fn = fn, .arg = arg, .helpers = helpers };
    atomic_store(&w->cur, &j);
    atomic_fetch_add(&w->gen, 1);
    /* A wake-up is a system call and, for an idle CPU, an interrupt: only for
     * helpers that went to sleep. A spinning one sees the new generation. */
    if (atomic_load(&w->sleepers) != 0)
        sp_futex_wake(&w->gen, INT32_MAX);
    par_drain(&j);
    /* Acquire: every chunk's writes are visible once it is counted. */
    while (atomic_load_explicit(&j.done, memory_order_acquire) < n)
        sp_cpu_relax();
    atomic_store(&w->cur, NULL);
    while (atomic_load(&w->active) != 0)
        sp_cpu_relax();
}

/* The size of the last-level cache from sysfs (sysconf's figure is wrong on
 * some virtual machines); 0 when unknown. */
static uint64_t llc_bytes(void)
{
    uint64_t best = 0;
    for (int i = 0; i < 8; i++) {
        char path[96];
        snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu0/cache/index%d/size", i);
        FILE *f = fopen(path, "r");
        if (f == NULL)
            continue;
        unsigned long long v;
        char unit = 0;
        if (fscanf(f, "%llu%c", &v, &unit) >= 1) {
            v <<= unit == 'K' ? 10 : unit == 'M' ? 20 : 0;
            if (v > best)
                best = v;
        }
        fclose(f);
    }
    return best;
}

int sp_workers_start(sp_engine_t *eng)
{
    /* Half the last-level cache: a task writing more would push out what the
     * ranks are about to read anyway. */
    uint64_t llc = llc_bytes();
    eng->stream_min_bytes = llc > 0 ? llc / 8 : 4u << 20;

    uint32_t want = (uint32_t)eng->cfg->copy_threads;
    if (want == 0) {
        cpu_set_t set;
        want = sched_getaffinity(0, sizeof set, &set) == 0 ? (uint32_t)CPU_COUNT(&set) : 1;
        if (want > 8)
            want = 8;
    }
    eng->copy_threads = want > 0 ? want : 1;
    if (eng->copy_threads == 1)
        return 0;

    struct sp_workers *w = calloc(1, sizeof *w);
    if (w == NULL || (w->threads = calloc(eng->copy_threads - 1, sizeof *w->threads)) == NULL) {
        free(w);
        sp_error(RING, "out of memory starting the copy workers");
        return -1;
    }
    for (uint32_t i = 0; i + 1 < eng->copy_threads; i++) {
        int rc = pthread_create(&w->threads[i], NULL, helper_main, w);
        if (rc != 0) {
            sp_warn(RING, "cannot start copy worker %u: %s; copying with %u threads", i + 1, strerror(rc), i + 1);
            break;
        }
        char name[16];
        snprintf(name, sizeof name, "spd-copy-%u", i + 1);
        pthread_setname_np(w->threads[i], name);
        w->n++;
    }
    eng->copy_threads = w->n + 1;
    eng->workers = w;
    cpu_set_t set;
    eng->ncpus = sched_getaffinity(0, sizeof set, &set) == 0 ? (uint32_t)CPU_COUNT(&set) : 1;
    sp_info(RING, "large copies use %u threads; streaming stores from %" PRIu64 " bytes", eng->copy_threads,
            eng->stream_min_bytes);
    return 0;
}

void sp_workers_stop(sp_engine_t *eng)
{
    struct sp_workers *w = eng->workers;
    if (w == NULL)
        return;
    atomic_store(&w->stop, true);
    sp_futex_bump_wake(&w->gen);
    for (uint32_t i = 0; i < w->n; i++)
        pthread_join(w->threads[i], NULL);
    free(w->threads);
    free(w);
    eng->workers = NULL;
}
