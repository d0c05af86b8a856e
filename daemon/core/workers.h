/*
 * workers.h — the copy workers (workers.c), threads that share a large copy
 * with the progress thread.
 */
#ifndef SP_CORE_WORKERS_H
#define SP_CORE_WORKERS_H

#include <stdint.h>

typedef struct sp_engine sp_engine_t;

/* Runs fn(arg, i) for i in [0, n) on the calling thread and up to `helpers`
 * workers; returns when every call has returned. */
typedef void (*sp_par_fn)(void *arg, uint32_t i);
void sp_parallel_for(sp_engine_t *eng, uint32_t n, uint32_t helpers, sp_par_fn fn, void *arg);
int  sp_workers_start(sp_engine_t *eng);
void sp_workers_stop(sp_engine_t *eng);

#endif /* SP_CORE_WORKERS_H */
