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
#include "engine.h"

#include <errno.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"
#include "sp_futex.h"

#define HELPER_SPIN_NS 20000   /* a helper polls this long for the next job before sleeping */

typedef struct par_job {
    uint32_t         n;
    sp_par_fn        fn;
    void            *arg;
    _Atomic uint32_t next;      /* next chunk to claim */
    _Atomic uint32_t done;      /* chunks finished */
} par_job_t;

struct sp_workers {
    pthread_t              *threads;
    uint32_t                n;
    _Atomic uint32_t        gen;      /* bumped per job; helpers sleep on it */
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
        if (j != NULL)
            par_drain(j);
        atomic_fetch_sub(&w->active, 1);

        uint64_t until = sp_now_ns() + HELPER_SPIN_NS;
        uint32_t g;
        while ((g = atomic_load(&w->gen)) == seen && sp_now_ns() < until)
            sp_cpu_relax();
        if (g == seen)
            sp_futex_wait(&w->gen, seen, 100 * 1000000LL);
        seen = atomic_load(&w->gen);
    }
    return NULL;
}

void sp_parallel_for(sp_engine_t *eng, uint32_t n, sp_par_fn fn, void *arg)
{
    struct sp_workers *w = eng->workers;
    if (w == NULL || w->n == 0 || n < 2) {
        for (uint32_t i = 0; i < n; i++)
            fn(arg, i);
        return;
    }
    par_job_t j = { .n = n, .fn = fn, .arg = arg };
    atomic_store(&w->cur, &j);
    sp_futex_bump_wake(&w->gen);
    par_drain(&j);
    /* Acquire: every chunk's writes are visible once it is counted. */
    while (atomic_load_explicit(&j.done, memory_order_acquire) < n)
        sp_cpu_relax();
    atomic_store(&w->cur, NULL);
    while (atomic_load(&w->active) != 0)
        sp_cpu_relax();
}

int sp_workers_start(sp_engine_t *eng)
{
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
    sp_info(RING, "large copies use %u threads", eng->copy_threads);
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
