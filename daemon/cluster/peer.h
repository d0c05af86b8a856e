/*
 * peer.h — links to the other daemons of the cluster (TCP, on the libuv loop).
 */
#ifndef SP_PEER_H
#define SP_PEER_H

#include <stdbool.h>
#include <stdint.h>
#include <uv.h>

#include "base/config.h"
#include "cluster/peer_auth.h"
#include "core/stats.h"
#include "spclient/status.h"
#include "spd.pb-c.h"

/* What an authenticated link tells the data path about its node. */
typedef struct sp_peer_session {
    const char *node;
    uint64_t    incarnation;                   /* the run of it that proved itself */
    uint8_t     send_key[SP_PEER_KEY_BYTES];   /* seals what this run sends that one */
    uint8_t     recv_key[SP_PEER_KEY_BYTES];   /* seals what that run sends this one */
    const void *ucx_address;                   /* on_up: its UCP worker */
    size_t      ucx_address_len;
} sp_peer_session_t;

typedef enum sp_peer_state {
    SP_PEER_CONNECTING,   /* dialling */
    SP_PEER_AUTH,         /* open; the two proofs are not both checked yet */
    SP_PEER_UP,
    SP_PEER_DOWN,         /* closed or silent; an outbound peer is redialled */
    SP_PEER_REFUSED,      /* the secrets differ; redialled too (the other side may be fixed) */
} sp_peer_state_t;

typedef struct sp_peer sp_peer_t;
typedef struct sp_peer_name sp_peer_name_t;

/* A cluster secret and its file as it was when last looked at: a file that
 * changes is read again on the heartbeat tick, so secrets rotate without a
 * restart. len 0: none (a next secret whose file is absent or empty). */
typedef struct sp_peer_secret {
    uint8_t  bytes[SP_PEER_SECRET_MAX];
    size_t   len;
    char     id[17];                 /* sp_peer_secret_id; "" with none */
    bool     looked;                 /* the file's identity below is known */
    uint64_t mtime_ns, ino, size;    /* all 0: the file was absent */
} sp_peer_secret_t;

typedef struct sp_peers {
    uv_loop_t         *loop;
    const sp_config_t *cfg;
    char               node[64];
    bool               enabled;       /* peer_listen or peers set */
    sp_peer_secret_t   secret;        /* cluster_secret_file: proves this daemon, and is accepted */
    sp_peer_secret_t   secret_next;   /* cluster_secret_next_file: accepted too, for rotation */

    uv_tcp_t           listener;
    bool               listening;
    char               listen_addr[96];   /* as bound: the port is the real one */
    uv_timer_t         tick;              /* heartbeats, silence, auth deadlines, redials */
    bool               tick_started;
    uint64_t           ran_ns;            /* when a timer of the loop last ran (sp_peers_awake) */
    uint64_t           held_ns;           /* in all, how long spd was held past its timers' time */

    sp_peer_t         *list;
    sp_peer_name_t    *names;         /* peers_dns: names whose every address is a peer */
    uint64_t           names_next_ns; /* when they are resolved again */
    uint64_t           refused_in;        /* inbound links that failed authentication */
    uint64_t           closed_at_accept;  /* inbound links closed at once (pending caps, fd_reserve) */
    uint64_t           closed_logged;
    uint64_t           rtt_lat[SP_LAT_BUCKETS];   /* heartbeat round trips of every link, by duration */
    uint64_t           rtt_sum_ns;
    char               closed_why[192];
    int64_t            fd_limit;          /* RLIMIT_NOFILE; 0: none */
    bool               closing;
    uint64_t           incarnation;       /* this run: random, named in hellos and data keys */

    /* Ours, sent in our last proof: where the other daemons send data (net.c). */
    const void        *ucx_address;
    size_t             ucx_address_len;

    /* What links mean to jobs, set by the server; called on the loop thread.
     * on_trusted: a link's other end proved itself; its data is to be taken
     * before our address goes out to it. on_up: a node is reachable (its UCP
     * worker address with it); on_down: the last link to it went; on_msg: a
     * message for jobs from an UP node; on_held: spd was held for held_ns
     * (sp_peers_awake), which no wait for another daemon is to count. */
    void             (*on_trusted)(void *arg, const sp_peer_session_t *s);
    void             (*on_up)(void *arg, const sp_peer_session_t *s);
    void             (*on_down)(void *arg, const char *node, const char *why);
    void             (*on_msg)(void *arg, const char *node, const Spd__Msg *msg);
    void             (*on_held)(void *arg, uint64_t held_ns);
    void              *hook_arg;
} sp_peers_t;

/* Reads the secrets, binds peer_listen, starts dialling `peers` and the
 * addresses of `peers_dns`. With none of the three set it does nothing and
 * returns 0. -1 (logged) on a configuration or bind error. */
int  sp_peers_init(sp_peers_t *ps, uv_loop_t *loop, const sp_config_t *cfg, const char *node);
/* Closes every link and the listener (shutdown). */
void sp_peers_close(sp_peers_t *ps);
/* From a timer of the loop, or before a wait for a daemon begins, at now:
 * the loop running far past its tick's time means spd
 * did not run meanwhile (the machine or the scheduler held it), while what the
 * peers sent waits unread, or, on a machine held as a whole, was never sent.
 * That time is not counted against them: their silence leaves it out, and
 * on_held tells the server. */
void sp_peers_awake(sp_peers_t *ps, uint64_t now);

const char *sp_peer_state_name(sp_peer_state_t st);

/* For queries: walks the links. */
typedef struct sp_peer_info {
    const char     *node;      /* "" until its hello came */
    const char     *addr;
    const char     *dns_name;  /* the peers_dns name it is an address of; "" for the others */
    bool            outbound;
    sp_peer_state_t state;
    const char     *why;       /* why it is down or refused; "" otherwise */
    double          since_s;   /* in this state */
    double          heard_ms;  /* since the last frame from it; -1: never */
    double          rtt_us;    /* last heartbeat round trip; -1: none yet */
    uint64_t        dials;     /* outbound: connections tried */
    double          redial_s;  /* outbound and not up: until the next try; -1 otherwise */
    uint32_t        protocol;  /* the peer protocol its hello and ours chose; 0: none yet */
} sp_peer_info_t;
void sp_peers_foreach(const sp_peers_t *ps, void (*fn)(void *arg, const sp_peer_info_t *p), void *arg);
uint32_t sp_peers_up(const sp_peers_t *ps);
/* Whether an UP link to `node` exists. */
bool sp_peers_is_up(const sp_peers_t *ps, const char *node);
/* Sends msg on an UP link to `node`; -1 when there is none (or it cannot be sent). */
int  sp_peers_send(sp_peers_t *ps, const char *node, const Spd__Msg *msg);

/* Drops every link to `node`, saying why (its data path broke its bounds). */
void sp_peers_drop(sp_peers_t *ps, const char *node, const char *why);

#endif /* SP_PEER_H */
