/*
 * net.h — the data path between daemons (net.c says how): a UCP worker whose
 * address travels in PeerHello, one endpoint per node. The engine reaches it
 * through its net transport (core/transport.h), which sp_net_init fills in;
 * the peer links drive the rest. Every call holds the engine lock (the lock
 * is what serialises the worker).
 */
#ifndef SP_NET_H
#define SP_NET_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/engine.h"
#include "core/job.h"

#define SP_NET_KEY_BYTES 32
/* incarnation: this run, as the links prove it. -1 (logged) when UCX cannot
 * start. On success the engine reaches the data path through eng->net_ops. */
int    sp_net_init(sp_engine_t *eng, uint64_t incarnation);
void   sp_net_cleanup(sp_engine_t *eng);
size_t sp_net_address(sp_engine_t *eng, const void **addr_p);
int    sp_net_efd(sp_engine_t *eng);                   /* readable when the worker has events */
/* A node's link authenticated run `incarnation` of it: its messages sealed
 * with key are taken from now on (a new run's stream starts over). */
int    sp_net_expect(sp_engine_t *eng, const char *node, uint64_t incarnation, const uint8_t key[SP_NET_KEY_BYTES]);
/* Where to send it data, and the key that seals what goes there. */
int    sp_net_connect(sp_engine_t *eng, const char *node, const void *addr, size_t len,
                      const uint8_t key[SP_NET_KEY_BYTES]);
/* Its last link went: nothing more is taken from it nor sent to it. */
void   sp_net_disconnect(sp_engine_t *eng, const char *node);
/* A node whose stream broke its bounds, for the loop thread to drop its
 * link (once each); false when none. */
bool   sp_net_take_broken(sp_engine_t *eng, char *node, size_t nlen, char *why, size_t wlen);
uint64_t sp_net_dropped(sp_engine_t *eng);              /* data-path messages dropped unread */
/* The copies kept for a peer's restart: their bytes now (at most
 * peer_restart_keep_bytes), and the messages not kept since start, past that
 * bound or out of memory. Caller holds the engine lock. */
void   sp_net_kept_counts(sp_engine_t *eng, uint64_t *bytes, uint64_t *not_kept);
/* The worker's fd is readable: progress until it is armed again (it is then
 * quiet until the next event). */
void   sp_net_poll_locked(sp_engine_t *eng);
/* Tells the other daemons of a job that its rank `rank` (here) left, on the
 * stream that carried its collectives, so they arrive first. */
void   sp_net_send_rank_lost(sp_engine_t *eng, sp_job_t *job, uint32_t rank, const char *why);
/* Daemon `node` (a job node index) took the job back after one of the two
 * restarted: this daemon's message for every collective of the job whose
 * ranks here are all in goes there again (the daemon before lost it, or it
 * was held back while the job waited). */
void   sp_net_resend(sp_engine_t *eng, sp_job_t *job, uint32_t node);

#endif /* SP_NET_H */
