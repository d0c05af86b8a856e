/*
 * peer.c — links to the other daemons of the cluster: dialled (`peers`, and
 * every address behind the names of `peers_dns`, resolved again from time to
 * time; redialled when they drop) and accepted (peer_listen), each carrying the
 * frames of the Unix socket. A peer goes CONNECTING → AUTH → UP → DOWN (or
 * REFUSED, with why); on_up/on_down tell the server when a node comes and
 * goes. One daemon per node name; strangers are bounded before they prove
 * anything (peer_max_pending, SP_PEER_HELLO_FRAME_MAX, fd_reserve). Why the
 * proofs are what they are: peer_auth.c. The rest of the story (liveness,
 * lifetimes, two links between the same runs): docs/architecture.md.
 */
#include "cluster/peer.h"

#include <inttypes.h>
#include <sodium.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>

#include "core/engine.h"
#include "base/log.h"
#include "base/netaddr.h"
#include "sp_msg.h"
#include "version.h"

#define PEER_AUTH_TIMEOUT_MS 5000
#define PEER_MAX_DOWN_INBOUND 64   /* records of authenticated inbound peers kept after they went */

typedef struct link link_t;

struct sp_peer {
    sp_peer_t      *next;
    sp_peers_t     *ps;
    bool            outbound;
    char            addr[96];
    char            ip[64];          /* addr without its port (inbound): pending links are counted per ip */
    char            node[SP_PEER_NODE_MAX];
    uint64_t        incarnation;     /* the other end's run, from its hello */
    uint32_t        protocol;        /* the peer protocol the two hellos chose; 0 before */
    sp_peer_state_t state;
    char            why[192];
    char            logged[192];     /* the last reason logged (outbound), to log a change once */
    uint64_t        since_ns, heard_ns, rtt_ns, next_dial_ns, beat_seq;
    uint64_t        held_at_heard;   /* the peers' held_ns at heard_ns */
    uint64_t        dials;           /* outbound: connections tried */
    uint32_t        failures;        /* outbound: dials since it was last up, for the backoff */
    sp_peer_name_t *name;            /* outbound: the peers_dns name it is an address of; NULL: `peers` */
    bool            resolved;        /* its name's last answer held it */
    bool            self;            /* its name's address of this daemon itself: never dialled again */
    link_t         *link;            /* the open connection; NULL when none */
};

struct link {
    uv_tcp_t          tcp;
    uv_connect_t      connect;
    uv_getaddrinfo_t  gai;
    sp_peer_t        *peer;          /* NULL once the peer let go */
    bool              resolving;
    bool              closing;
    bool              hello_in;
    bool              proved;          /* dialer: our first proof is sent */
    bool              trusted;         /* their proof checked */
    uint8_t           nonce[SP_PEER_NONCE_BYTES];
    uint8_t          *my_hello;        /* our PeerHello frame as sent, until the transcript is taken */
    size_t            my_hello_len;
    uint8_t           transcript[SP_PEER_PROOF_BYTES];
    uint8_t          *their_ucx;       /* their UCP worker address, from their proof */
    size_t            their_ucx_len;
    uint8_t          *rbuf;
    size_t            rlen, rcap;
    /* The dialer's secret: its proofs are made with it and the data keys come
     * from it. The dialer takes its current one when it proves itself; the
     * acceptor, whichever of its own checked that proof. */
    uint8_t           secret[SP_PEER_SECRET_MAX];
    size_t            secret_len;
};

/* A name of peers_dns, resolved on its own. Freed by sp_peers_close, or by
 * its last resolution's callback when that was still to come. */
struct sp_peer_name {
    sp_peer_name_t  *next;
    sp_peers_t      *ps;             /* NULL: spd let go while it resolved */
    char             host[80], port[16];
    uv_getaddrinfo_t req;
    bool             resolving;
    char             why[160];       /* the last failure to resolve, logged once */
};

typedef struct write_req {
    uv_write_t req;
    uint8_t   *buf;
} write_req_t;

const char *sp_peer_state_name(sp_peer_state_t st)
{
    switch (st) {
    case SP_PEER_CONNECTING: return "connecting";
    case SP_PEER_AUTH:       return "authenticating";
    case SP_PEER_UP:         return "up";
    case SP_PEER_DOWN:       return "down";
    case SP_PEER_REFUSED:    return "refused";
    }
    return "?";
}

/* ================================================================ links */

static void link_free(uv_handle_t *h)
{
    link_t *l = h->data;
    sodium_memzero(l->secret, sizeof l->secret);
    free(l->my_hello);
    free(l->their_ucx);
    free(l->rbuf);
    free(l);
}

/* Lets go of a link: it closes, and frees itself once libuv is done with it. */
static void link_close(link_t *l)
{
    if (l->closing)
        return;
    l->closing = true;
    l->peer = NULL;
    if (l->resolving)
        uv_cancel((uv_req_t *)&l->gai);   /* on_resolved closes the handle */
    else
        uv_close((uv_handle_t *)&l->tcp, link_free);
}

static link_t *link_new(sp_peer_t *p)
{
    link_t *l = calloc(1, sizeof *l);
    if (l == NULL)
        return NULL;
    uv_tcp_init(p->ps->loop, &l->tcp);
    l->tcp.data = l;
    l->peer = p;
    randombytes_buf(l->nonce, sizeof l->nonce);
    p->link = l;
    return l;
}

static void on_write(uv_write_t *req, int status)
{
    write_req_t *w = (write_req_t *)req;
    if (status < 0 && status != UV_ECANCELED)
        sp_debug(PEER, "write failed: %s", uv_strerror(status));
    free(w->buf);
    free(w);
}

/* Writes a frame; takes buf. */
static int link_write(link_t *l, uint8_t *buf, size_t len)
{
    write_req_t *w = calloc(1, sizeof *w);
    if (w == NULL) {
        free(buf);
        return -1;
    }
    w->buf = buf;
    uv_buf_t b = uv_buf_init((char *)buf, (unsigned)len);
    if (uv_write(&w->req, (uv_stream_t *)&l->tcp, &b, 1, on_write) != 0) {
        free(buf);
        free(w);
        return -1;
    }
    return 0;
}

static int link_send(link_t *l, const Spd__Msg *msg)
{
    uint8_t *buf;
    size_t len;
    if (sp_msg_encode(msg, &buf, &len) != 0)
        return -1;
    return link_write(l, buf, len);
}

/* ================================================================ peer state */

static void peer_set(sp_peer_t *p, sp_peer_state_t st, const char *why)
{
    p->state = st;
    p->since_ns = sp_now_ns();
    snprintf(p->why, sizeof p->why, "%s", why ? why : "");
}

static void peer_unlink(sp_peers_t *ps, sp_peer_t *p)
{
    for (sp_peer_t **pp = &ps->list; *pp != NULL; pp = &(*pp)->next) {
        if (*pp == p) {
            *pp = p->next;
            return;
        }
    }
}

/* Drops inbound records beyond the newest PEER_MAX_DOWN_INBOUND that are down. */
static void peers_trim(sp_peers_t *ps)
{
    uint32_t kept = 0;
    for (sp_peer_t **pp = &ps->list; *pp != NULL;) {
        sp_peer_t *p = *pp;
        bool down = !p->outbound && (p->state == SP_PEER_DOWN || p->state == SP_PEER_REFUSED);
        if (down && ++kept > PEER_MAX_DOWN_INBOUND) {
            *pp = p->next;
            free(p);
        } else {
            pp = &p->next;
        }
    }
}

static sp_peer_t *peer_older(sp_peers_t *ps, const sp_peer_t *p);

/*
 * How long an outbound peer waits before it is dialled again: a heartbeat
 * interval after its first failure, doubling with each failure since it was
 * last up, to peer_redial_max_ms. Each wait is drawn from its upper half, so
 * that the daemons of a fleet that lost a node together do not dial it in
 * step when it comes back.
 */
static uint64_t redial_delay_ns(const sp_peers_t *ps, uint32_t failures)
{
    uint64_t ms = (uint64_t)ps->cfg->peer_heartbeat_ms, max = (uint64_t)ps->cfg->peer_redial_max_ms;
    for (uint32_t i = 0; i < failures && ms < max; i++)
        ms *= 2;
    if (ms > max)
        ms = max;
    uint64_t half = ms / 2;
    return (half + randombytes_uniform((uint32_t)(ms - half) + 1)) * 1000000u;
}

/*
 * The link ends: the peer becomes DOWN or REFUSED with the reason. An outbound
 * peer is dialled again after a backoff (redial_delay_ns). An inbound one that never said
 * who it is is forgotten; one that did is kept for spctl, folded into the record
 * its node already has. Frees at most p itself, so a caller walking the list
 * may go on from p->next saved beforehand.
 */
static void peer_down(sp_peer_t *p, sp_peer_state_t st, const char *why)
{
    sp_peers_t *ps = p->ps;
    bool was_up = p->state == SP_PEER_UP;
    if (p->link != NULL) {
        link_close(p->link);
        p->link = NULL;
    }
    sp_peer_t *older = !p->outbound && p->node[0] != '\0' ? peer_older(ps, p) : NULL;
    /* A peer that keeps failing the same way (redialled every heartbeat, or
     * dialling us every heartbeat) is logged once, and again when that changes. */
    bool quiet;
    if (p->outbound) {
        quiet = !was_up && strcmp(p->logged, why) == 0;
        snprintf(p->logged, sizeof p->logged, "%s", why);
    } else {
        quiet = !was_up && older != NULL && older->state == st && strcmp(older->why, why) == 0;
    }
    if (was_up) {
        sp_warn(PEER, "peer %s (%s) down: %s", p->node, p->addr, why);
        p->state = SP_PEER_DOWN;   /* before asking whether another link is up */
        if (!sp_peers_is_up(ps, p->node) && ps->on_down != NULL && !ps->closing)
            ps->on_down(ps->hook_arg, p->node, why);
    }
    else if (!quiet && st == SP_PEER_REFUSED)
        sp_warn(PEER, "peer %s (%s) refused: %s", p->node[0] ? p->node : "?", p->addr, why);
    else if (!quiet)
        sp_info(PEER, "peer %s (%s): %s", p->node[0] ? p->node : "?", p->addr, why);
    peer_set(p, st, why);
    if (p->outbound) {
        p->next_dial_ns = sp_now_ns() + redial_delay_ns(ps, p->failures++);
        return;
    }
    if (older != NULL) {
        snprintf(older->addr, sizeof older->addr, "%s", p->addr);
        older->heard_ns = p->heard_ns;
        older->held_at_heard = p->held_at_heard;
        older->rtt_ns = p->rtt_ns;
        peer_set(older, st, why);
    }
    if (older != NULL || p->node[0] == '\0') {
        peer_unlink(ps, p);
        free(p);
    }
}

/* The closed inbound record of p's node, other than p; NULL when none. */
static sp_peer_t *peer_older(sp_peers_t *ps, const sp_peer_t *p)
{
    for (sp_peer_t *o = ps->list; o != NULL; o = o->next)
        if (o != p && !o->outbound && o->link == NULL && strcmp(o->node, p->node) == 0)
            return o;
    return NULL;
}

/* ================================================================ protocol */

static void send_error(link_t *l, spc_status_t st, const char *detail)
{
    Spd__Msg m = SPD__MSG__INIT;
    Spd__Error e = SPD__ERROR__INIT;
    e.status = st;
    e.detail = (char *)detail;
    m.body_case = SPD__MSG__BODY_ERROR;
    m.error = &e;
    link_send(l, &m);
}

/* Our hello; its frame is kept for the transcript. */
static void send_hello(link_t *l)
{
    sp_peers_t *ps = l->peer->ps;
    Spd__Msg m = SPD__MSG__INIT;
    Spd__PeerHello h = SPD__PEER_HELLO__INIT;
    h.protocol = SP_PEER_PROTOCOL_MIN;   /* the lowest, where a daemon from before ranges looks */
    h.protocol_max = SP_PEER_PROTOCOL_VERSION;
    h.node = ps->node;
    h.nonce.data = l->nonce;
    h.nonce.len = sizeof l->nonce;
    h.version = (char *)SPD_VERSION;
    h.incarnation = ps->incarnation;
    m.body_case = SPD__MSG__BODY_PEER_HELLO;
    m.peer_hello = &h;
    uint8_t *buf;
    size_t len;
    if (sp_msg_encode(&m, &buf, &len) != 0 || (l->my_hello = malloc(len)) == NULL) {
        peer_down(l->peer, SP_PEER_DOWN, "out of memory");
        return;
    }
    memcpy(l->my_hello, buf, len);
    l->my_hello_len = len;
    link_write(l, buf, len);
}

/* A proof of ours for this link's step, with our data address when `addr`. */
static void send_auth(link_t *l, sp_peer_step_t step, bool addr)
{
    sp_peers_t *ps = l->peer->ps;
    const void *ua = addr ? ps->ucx_address : NULL;
    size_t ulen = addr ? ps->ucx_address_len : 0;
    uint8_t proof[SP_PEER_PROOF_BYTES];
    if (step == SP_PEER_STEP_DIALER) {
        memcpy(l->secret, ps->secret.bytes, ps->secret.len);
        l->secret_len = ps->secret.len;
    }
    if (step == SP_PEER_STEP_ACCEPTOR)
        sp_peer_proof(ps->secret.bytes, ps->secret.len, step, l->transcript, ua, ulen, proof);
    else
        sp_peer_proof(l->secret, l->secret_len, step, l->transcript, ua, ulen, proof);
    Spd__Msg m = SPD__MSG__INIT;
    Spd__PeerAuth a = SPD__PEER_AUTH__INIT;
    a.proof.data = proof;
    a.proof.len = sizeof proof;
    a.ucx_address.data = (uint8_t *)ua;
    a.ucx_address.len = ulen;
    m.body_case = SPD__MSG__BODY_PEER_AUTH;
    m.peer_auth = &a;
    link_send(l, &m);
}

static void send_beat(link_t *l, uint64_t seq, uint64_t sent_ns, bool ack)
{
    Spd__Msg m = SPD__MSG__INIT;
    Spd__PeerBeat b = SPD__PEER_BEAT__INIT;
    b.seq = seq;
    b.sent_ns = sent_ns;
    b.ack = ack;
    m.body_case = SPD__MSG__BODY_PEER_BEAT;
    m.peer_beat = &b;
    link_send(l, &m);
}

/* Refuses the other end: it hears why, then the link closes. */
static void peer_refuse(sp_peer_t *p, spc_status_t st, const char *detail)
{
    send_error(p->link, st, detail);
    if (!p->outbound)
        p->ps->refused_in++;
    peer_down(p, SP_PEER_REFUSED, detail);
}

/*
 * Whether p may speak for its node: not when another link of that node is
 * trusted and comes from another run, or goes the same way (a second daemon
 * under the same name, or a second address of the same one). The dialled and
 * the accepted link between the same two runs are the same daemon, both kept.
 */
static spc_status_t peer_claim_ok(sp_peers_t *ps, const sp_peer_t *p, sp_err_t *e)
{
    for (const sp_peer_t *q = ps->list; q != NULL; q = q->next) {
        if (q == p || q->link == NULL || !q->link->trusted || strcmp(q->node, p->node) != 0)
            continue;
        if (q->incarnation != p->incarnation || q->outbound == p->outbound)
            return sp_err_set(e, SPC_ERR_BUSY, "node %s is linked already (%s, %s); a second daemon claims its name "
                              "from %s", p->node, q->addr, q->outbound ? "dialled" : "accepted", p->addr);
    }
    return SPC_OK;
}

/* The session with p's node, for net.c: its run and the two data keys. */
static void peer_session(const sp_peer_t *p, sp_peer_session_t *s)
{
    const sp_peers_t *ps = p->ps;
    const link_t *l = p->link;   /* trusted: it holds the dialer's secret */
    memset(s, 0, sizeof *s);
    s->node = p->node;
    s->incarnation = p->incarnation;
    sp_peer_data_key(l->secret, l->secret_len, ps->node, ps->incarnation, p->node, p->incarnation, s->send_key);
    sp_peer_data_key(l->secret, l->secret_len, p->node, p->incarnation, ps->node, ps->incarnation, s->recv_key);
    s->ucx_address = l->their_ucx;
    s->ucx_address_len = l->their_ucx_len;
}

static void on_hello(sp_peer_t *p, const Spd__PeerHello *h, const uint8_t *frame, size_t frame_len)
{
    sp_peers_t *ps = p->ps;
    link_t *l = p->link;
    sp_err_t e = SP_ERR_INIT;

    if (l->hello_in) {
        peer_refuse(p, SPC_ERR_PROTOCOL, "a second PeerHello on one link");
        return;
    }
    uint32_t protocol;
    if (sp_peer_hello_check(h, ps->node, &protocol, &e) != SPC_OK) {
        /* A name's addresses include this daemon's own when it is one of the set. */
        p->self = p->name != NULL && e.status == SPC_ERR_INVALID_ARG && strcmp(h->node, ps->node) == 0;
        peer_refuse(p, e.status, p->self ? "this daemon itself: not dialled again" : e.msg);
        return;
    }
    if (l->my_hello == NULL) {   /* ours always goes first: the link started with it */
        peer_refuse(p, SPC_ERR_PROTOCOL, "PeerHello out of order");
        return;
    }
    l->hello_in = true;
    p->protocol = protocol;
    p->incarnation = h->incarnation;
    snprintf(p->node, sizeof p->node, "%s", h->node);
    if (p->outbound)
        sp_peer_transcript(l->my_hello, l->my_hello_len, frame, frame_len, l->transcript);
    else
        sp_peer_transcript(frame, frame_len, l->my_hello, l->my_hello_len, l->transcript);
    free(l->my_hello);
    l->my_hello = NULL;
    if (p->outbound) {   /* the dialer proves itself first */
        send_auth(l, SP_PEER_STEP_DIALER, false);
        l->proved = true;
    }
}

/* Their proof checked: the other end is a daemon of this cluster. Before our
 * data address goes out, net.c is told to take its messages. */
static spc_status_t peer_trust(sp_peer_t *p, sp_err_t *e)
{
    SP_CHECK(peer_claim_ok(p->ps, p, e));
    p->link->trusted = true;
    if (p->ps->on_trusted != NULL) {
        sp_peer_session_t s;
        peer_session(p, &s);
        p->ps->on_trusted(p->ps->hook_arg, &s);
        sodium_memzero(&s, sizeof s);
    }
    return SPC_OK;
}

static void peer_up(sp_peer_t *p)
{
    sp_peers_t *ps = p->ps;
    sp_peer_t *older;
    if (!p->outbound && (older = peer_older(ps, p)) != NULL) {   /* p replaces it */
        peer_unlink(ps, older);
        free(older);
    }
    p->logged[0] = '\0';
    p->failures = 0;
    bool already = sp_peers_is_up(ps, p->node);
    peer_set(p, SP_PEER_UP, "");
    sp_info(PEER, "peer %s (%s, %s) up", p->node, p->addr, p->outbound ? "dialled" : "accepted");
    if (!already && ps->on_up != NULL) {
        sp_peer_session_t s;
        peer_session(p, &s);
        ps->on_up(ps->hook_arg, &s);
        sodium_memzero(&s, sizeof s);
    }
}

static bool keep_address(link_t *l, const Spd__PeerAuth *a)
{
    if ((l->their_ucx = malloc(a->ucx_address.len)) == NULL)
        return false;
    memcpy(l->their_ucx, a->ucx_address.data, a->ucx_address.len);
    l->their_ucx_len = a->ucx_address.len;
    return true;
}

/* The secret of ours that a proof was made with, the current one or the next
 * (both are accepted, so that a secret rotates one daemon at a time); NULL
 * when neither. */
static const sp_peer_secret_t *proof_secret(const sp_peers_t *ps, sp_peer_step_t step,
                                            const uint8_t transcript[SP_PEER_PROOF_BYTES], const Spd__PeerAuth *a)
{
    if (sp_peer_auth_check(ps->secret.bytes, ps->secret.len, step, transcript, a))
        return &ps->secret;
    if (ps->secret_next.len > 0 && sp_peer_auth_check(ps->secret_next.bytes, ps->secret_next.len, step, transcript, a))
        return &ps->secret_next;
    return NULL;
}

/*
 * The three proofs, in the only order they may come: on the acceptor the
 * dialer's (then ours goes out, with our address), then the dialer's address;
 * on the dialer the acceptor's (then our address goes out).
 */
static void on_auth(sp_peer_t *p, const Spd__PeerAuth *a)
{
    sp_peers_t *ps = p->ps;
    link_t *l = p->link;
    sp_err_t e = SP_ERR_INIT;

    if (!l->hello_in || p->state != SP_PEER_AUTH || (p->outbound && (!l->proved || l->trusted))) {
        peer_refuse(p, SPC_ERR_PROTOCOL, "PeerAuth out of order");
        return;
    }
    sp_peer_step_t step = p->outbound ? SP_PEER_STEP_ACCEPTOR
                          : l->trusted ? SP_PEER_STEP_DIALER_ADDRESS
                                       : SP_PEER_STEP_DIALER;
    const sp_peer_secret_t *ok = proof_secret(ps, step, l->transcript, a);
    if (ok == NULL) {
        sp_err_set(&e, SPC_ERR_PERMISSION, "node %s does not hold this cluster's secret (cluster_secret_file differs)",
                   p->node);
        peer_refuse(p, e.status, e.msg);
        return;
    }
    if (step == SP_PEER_STEP_DIALER) {   /* the acceptor takes the dialer's secret */
        memcpy(l->secret, ok->bytes, ok->len);
        l->secret_len = ok->len;
    }
    if (step != SP_PEER_STEP_DIALER && !keep_address(l, a)) {
        peer_down(p, SP_PEER_DOWN, "out of memory");
        return;
    }
    if (step == SP_PEER_STEP_DIALER_ADDRESS) {
        peer_up(p);
        return;
    }
    if (peer_trust(p, &e) != SPC_OK) {
        peer_refuse(p, e.status, e.msg);   /* logged as refused, with the reason */
        return;
    }
    if (p->outbound) {
        send_auth(l, SP_PEER_STEP_DIALER_ADDRESS, true);
        peer_up(p);
    } else {
        send_auth(l, SP_PEER_STEP_ACCEPTOR, true);
    }
}

static void on_msg(sp_peer_t *p, const Spd__Msg *msg, const uint8_t *frame, size_t frame_len)
{
    char detail[192];
    p->heard_ns = sp_now_ns();
    p->held_at_heard = p->ps->held_ns;
    switch (msg->body_case) {
    case SPD__MSG__BODY_PEER_HELLO:
        on_hello(p, msg->peer_hello, frame, frame_len);
        return;
    case SPD__MSG__BODY_PEER_AUTH:
        on_auth(p, msg->peer_auth);
        return;
    case SPD__MSG__BODY_ERROR:
        snprintf(detail, sizeof detail, "refused by %s: %s", p->node[0] ? p->node : p->addr, msg->error->detail);
        peer_down(p, msg->error->status == SPC_ERR_PERMISSION || msg->error->status == SPC_ERR_BUSY ? SP_PEER_REFUSED
                                                                                                  : SP_PEER_DOWN,
                  detail);
        return;
    default:
        break;
    }
    if (p->state != SP_PEER_UP) {
        snprintf(detail, sizeof detail, "%s before authentication", sp_msg_body_name(msg));
        peer_refuse(p, SPC_ERR_PERMISSION, detail);
        return;
    }
    if (msg->body_case == SPD__MSG__BODY_PEER_BEAT) {
        const Spd__PeerBeat *b = msg->peer_beat;
        if (b->ack && b->sent_ns <= p->heard_ns) {   /* it echoes our clock: a later one is not ours */
            p->rtt_ns = p->heard_ns - b->sent_ns;
            p->ps->rtt_lat[sp_stats_bucket_of(p->rtt_ns)]++;
            p->ps->rtt_sum_ns += p->rtt_ns;
        } else if (!b->ack)
            send_beat(p->link, b->seq, b->sent_ns, true);
        return;
    }
    if (p->ps->on_msg != NULL) {
        p->ps->on_msg(p->ps->hook_arg, p->node, msg);
        return;
    }
    sp_debug(PEER, "peer %s: ignoring %s", p->node, sp_msg_body_name(msg));
}

/* The largest frame the other end may send now: a stranger that dialled us
 * may send a hello and a proof, no more, until its proof checks. */
static uint32_t link_frame_max(const link_t *l)
{
    const sp_peer_t *p = l->peer;
    return p != NULL && !p->outbound && !l->trusted ? SP_PEER_HELLO_FRAME_MAX : (uint32_t)p->ps->cfg->max_frame_bytes;
}

static void on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf)
{
    (void)suggested;
    link_t *l = h->data;
    const size_t chunk = l->peer != NULL && link_frame_max(l) == SP_PEER_HELLO_FRAME_MAX ? SP_PEER_HELLO_FRAME_MAX
                                                                                          : 64 * 1024;
    if (l->rcap - l->rlen < chunk) {
        size_t cap = l->rcap ? l->rcap * 2 : chunk * 2;
        while (cap - l->rlen < chunk)
            cap *= 2;
        uint8_t *nb = realloc(l->rbuf, cap);
        if (nb == NULL) {
            *buf = uv_buf_init(NULL, 0);
            return;
        }
        l->rbuf = nb;
        l->rcap = cap;
    }
    *buf = uv_buf_init((char *)l->rbuf + l->rlen, (unsigned)(l->rcap - l->rlen));
}

static void on_read(uv_stream_t *stream, ssize_t nread, const uv_buf_t *buf)
{
    (void)buf;
    link_t *l = stream->data;
    sp_peer_t *p = l->peer;
    char detail[192];

    if (p == NULL)
        return;
    if (nread < 0) {
        /* A peer that dies with unread data in its socket resets the link rather
         * than closing it: for the jobs both mean it is gone. */
        snprintf(detail, sizeof detail, "%s",
                 nread == UV_EOF          ? "the other end closed the link"
                 : nread == UV_ECONNRESET ? "the other end closed the link (reset)"
                 : nread == UV_ENOBUFS    ? "out of memory for its frames"
                                          : uv_strerror((int)nread));
        peer_down(p, SP_PEER_DOWN, detail);
        return;
    }
    l->rlen += (size_t)nread;
    size_t off = 0;
    while (p->link == l) {
        sp_frame_t f;
        uint32_t max = link_frame_max(l);
        sp_frame_result_t r = sp_frame_parse(l->rbuf + off, l->rlen - off, max, &f);
        if (r == SP_FRAME_NEED_MORE)
            break;
        if (r != SP_FRAME_OK) {
            if (r == SP_FRAME_TOO_BIG && max == SP_PEER_HELLO_FRAME_MAX)
                snprintf(detail, sizeof detail, "frame of %u bytes before authentication (at most %u)", f.length,
                         max);
            else if (r == SP_FRAME_TOO_BIG)
                snprintf(detail, sizeof detail, "frame of %u bytes exceeds max_frame_bytes", f.length);
            else
                snprintf(detail, sizeof detail, "bad frame: %s", sp_frame_result_str(r));
            peer_refuse(p, SPC_ERR_PROTOCOL, detail);
            return;
        }
        Spd__Msg *msg = sp_msg_decode(&f);
        const uint8_t *frame = l->rbuf + off;
        off += f.frame_bytes;
        if (msg == NULL) {
            peer_refuse(p, SPC_ERR_PROTOCOL, "a frame that does not decode as spd.Msg");
            return;
        }
        on_msg(p, msg, frame, f.frame_bytes);
        sp_msg_free(msg);
        if (l->peer == NULL)   /* the message ended the link (and maybe freed the peer) */
            return;
    }
    if (off > 0) {
        memmove(l->rbuf, l->rbuf + off, l->rlen - off);
        l->rlen -= off;
    }
}

/* The link is open: hello out, frames in. */
static void link_start(link_t *l)
{
    sp_peer_t *p = l->peer;
    peer_set(p, SP_PEER_AUTH, "");
    p->heard_ns = 0;
    p->rtt_ns = 0;
    uv_tcp_nodelay(&l->tcp, 1);
    uv_read_start((uv_stream_t *)&l->tcp, on_alloc, on_read);
    send_hello(l);
}

/* ================================================================ dialling */

static int split_addr(const char *addr, char *host, size_t hlen, char *port, size_t plen)
{
    const char *colon = strrchr(addr, ':');
    if (colon == NULL || colon[1] == '\0')
        return -1;
    const char *h = addr;
    size_t n = (size_t)(colon - addr);
    if (n >= 2 && h[0] == '[' && h[n - 1] == ']') {
        h++;
        n -= 2;
    }
    if (n == 0 || n >= hlen || strlen(colon + 1) >= plen)
        return -1;
    memcpy(host, h, n);
    host[n] = '\0';
    snprintf(port, plen, "%s", colon + 1);
    return 0;
}

static void on_connected(uv_connect_t *req, int status)
{
    link_t *l = req->data;
    sp_peer_t *p = l->peer;
    if (p == NULL)
        return;
    if (status < 0) {
        char detail[192];
        snprintf(detail, sizeof detail, "connect: %s", uv_strerror(status));
        peer_down(p, SP_PEER_DOWN, detail);
        return;
    }
    link_start(l);
}

static void on_resolved(uv_getaddrinfo_t *req, int status, struct addrinfo *res)
{
    link_t *l = req->data;
    sp_peer_t *p = l->peer;
    l->resolving = false;
    if (l->closing) {
        uv_freeaddrinfo(res);
        uv_close((uv_handle_t *)&l->tcp, link_free);
        return;
    }
    char detail[192];
    int rc = status;
    if (rc == 0) {
        l->connect.data = l;
        rc = uv_tcp_connect(&l->connect, &l->tcp, res->ai_addr, on_connected);
    }
    uv_freeaddrinfo(res);
    if (rc != 0) {
        snprintf(detail, sizeof detail, "%s: %s", status != 0 ? "resolve" : "connect", uv_strerror(rc));
        peer_down(p, SP_PEER_DOWN, detail);
    }
}

static void peer_dial(sp_peer_t *p)
{
    char host[80], port[16];
    struct addrinfo hints = { .ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM };
    link_t *l = link_new(p);
    if (l == NULL) {
        peer_down(p, SP_PEER_DOWN, "out of memory");
        return;
    }
    peer_set(p, SP_PEER_CONNECTING, "");
    p->dials++;
    split_addr(p->addr, host, sizeof host, port, sizeof port);   /* checked at init */
    l->gai.data = l;
    l->resolving = true;
    int rc = uv_getaddrinfo(p->ps->loop, &l->gai, on_resolved, host, port, &hints);
    if (rc != 0) {
        l->resolving = false;
        char detail[192];
        snprintf(detail, sizeof detail, "resolve: %s", uv_strerror(rc));
        peer_down(p, SP_PEER_DOWN, detail);
    }
}

/* ================================================================ listening, ticking */

/* Inbound links still authenticating: all of them, and those from `ip`. */
static void count_pending(const sp_peers_t *ps, const char *ip, uint32_t *all_p, uint32_t *from_ip_p)
{
    *all_p = *from_ip_p = 0;
    for (const sp_peer_t *p = ps->list; p != NULL; p = p->next) {
        if (p->outbound || p->link == NULL || p->state != SP_PEER_AUTH)
            continue;
        (*all_p)++;
        *from_ip_p += strcmp(p->ip, ip) == 0;
    }
}

/* Why a new inbound link from `ip` is closed at once, or NULL to take it. The
 * kernel gives the lowest free descriptor, so one at or past the reserve line
 * means fewer than fd_reserve are left for clients. */
static const char *accept_refusal(const sp_peers_t *ps, const char *ip, int fd)
{
    uint32_t all, from_ip;
    count_pending(ps, ip, &all, &from_ip);
    if (all >= (uint32_t)ps->cfg->peer_max_pending)
        return "peer_max_pending links are authenticating";
    if (from_ip >= (uint32_t)ps->cfg->peer_max_pending_per_addr)
        return "peer_max_pending_per_addr links from its address are authenticating";
    if (ps->fd_limit > 0 && fd >= 0 && (int64_t)fd >= ps->fd_limit - ps->cfg->fd_reserve)
        return "fewer than fd_reserve descriptors are left for clients";
    return NULL;
}

static void peer_address(uv_tcp_t *tcp, char *ip, size_t iplen, char *addr, size_t addrlen)
{
    struct sockaddr_storage sa = { .ss_family = AF_UNSPEC };
    int len = sizeof sa;
    uv_tcp_getpeername(tcp, (struct sockaddr *)&sa, &len);   /* on failure: "?" */
    sp_addr_name(&sa, ip, iplen, addr, addrlen);
}

static void on_connection(uv_stream_t *listener, int status)
{
    sp_peers_t *ps = listener->data;
    if (status < 0) {
        sp_warn(PEER, "accept: %s", uv_strerror(status));
        return;
    }
    sp_peer_t *p = calloc(1, sizeof *p);
    if (p != NULL)
        p->ps = ps;
    link_t *l = p ? link_new(p) : NULL;
    if (l == NULL) {
        free(p);
        sp_error(PEER, "out of memory accepting a peer");
        return;
    }
    if (uv_accept(listener, (uv_stream_t *)&l->tcp) != 0) {
        link_close(l);
        free(p);
        return;
    }
    peer_address(&l->tcp, p->ip, sizeof p->ip, p->addr, sizeof p->addr);
    uv_os_fd_t fd = -1;
    uv_fileno((uv_handle_t *)&l->tcp, &fd);
    const char *why = accept_refusal(ps, p->ip, fd);
    if (why != NULL) {
        /* Logged once a tick with a count (on_tick): a flood must not flood the log. */
        if (ps->closed_at_accept++ == ps->closed_logged)
            snprintf(ps->closed_why, sizeof ps->closed_why, "%s (the last from %s)", why, p->addr);
        link_close(l);
        free(p);
        return;
    }
    p->next = ps->list;
    ps->list = p;
    link_start(l);
    peers_trim(ps);
}

/* ================================================================ peers_dns */

static sp_peer_t *peer_outbound_new(sp_peers_t *ps, const char *addr)
{
    sp_peer_t *p = calloc(1, sizeof *p);
    if (p == NULL)
        return NULL;
    p->ps = ps;
    p->outbound = true;
    snprintf(p->addr, sizeof p->addr, "%s", addr);
    peer_set(p, SP_PEER_DOWN, "not dialled yet");
    p->next = ps->list;
    ps->list = p;
    return p;
}

static uint32_t names_peers(const sp_peers_t *ps)
{
    uint32_t n = 0;
    for (const sp_peer_t *p = ps->list; p != NULL; p = p->next)
        n += p->name != NULL;
    return n;
}

/*
 * A name's answer: each address not dialled yet becomes an outbound peer,
 * while the name's peers stay under peers_dns_max; the name's peers whose
 * address it no longer gives go (their link closes). A failure to resolve
 * keeps the peers there were: a DNS server down for a while must not cut the
 * cluster apart.
 */
static void on_name_resolved(uv_getaddrinfo_t *req, int status, struct addrinfo *res)
{
    sp_peer_name_t *n = req->data;
    sp_peers_t *ps = n->ps;
    n->resolving = false;
    if (ps == NULL) {   /* spd let go of it meanwhile */
        uv_freeaddrinfo(res);
        free(n);
        return;
    }
    if (status != 0) {
        char why[160];
        snprintf(why, sizeof why, "%s", uv_strerror(status));
        if (strcmp(why, n->why) != 0)
            sp_warn(PEER, "peers_dns %s: %s; its peers are kept until it answers", n->host, why);
        snprintf(n->why, sizeof n->why, "%s", why);
        return;
    }
    n->why[0] = '\0';
    for (sp_peer_t *p = ps->list; p != NULL; p = p->next)
        if (p->name == n)
            p->resolved = false;
    uint32_t added = 0, skipped = 0, gone = 0, have = names_peers(ps);
    for (const struct addrinfo *ai = res; ai != NULL; ai = ai->ai_next) {
        struct sockaddr_storage sa = { .ss_family = AF_UNSPEC };
        char addr[96];
        memcpy(&sa, ai->ai_addr, ai->ai_addrlen < sizeof sa ? ai->ai_addrlen : sizeof sa);
        sp_addr_name(&sa, NULL, 0, addr, sizeof addr);
        sp_peer_t *p = ps->list;
        while (p != NULL && !(p->outbound && strcmp(p->addr, addr) == 0))
            p = p->next;
        if (p != NULL) {   /* dialled already: by this name, another, or `peers` */
            p->resolved = true;
            continue;
        }
        if (have >= (uint32_t)ps->cfg->peers_dns_max || (p = peer_outbound_new(ps, addr)) == NULL) {
            skipped++;
            continue;
        }
        p->name = n;
        p->resolved = true;
        have++;
        added++;
    }
    uv_freeaddrinfo(res);
    for (sp_peer_t *p = ps->list, *next; p != NULL; p = next) {
        next = p->next;
        if (p->name != n || p->resolved)
            continue;
        char why[192];
        snprintf(why, sizeof why, "no longer an address of %s", n->host);
        peer_down(p, SP_PEER_DOWN, why);   /* outbound: it stays in the list */
        peer_unlink(ps, p);
        free(p);
        gone++;
    }
    if (added > 0 || gone > 0)
        sp_info(PEER, "peers_dns %s: %u peer(s) added, %u gone", n->host, added, gone);
    if (skipped > 0)
        sp_warn(PEER, "peers_dns %s: %u address(es) left out: peers_dns_max (%" PRId64 ") peers from names already",
                n->host, skipped, ps->cfg->peers_dns_max);
}

static void name_resolve(sp_peer_name_t *n)
{
    if (n->resolving)
        return;
    struct addrinfo hints = { .ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM };
    n->req.data = n;
    int rc = uv_getaddrinfo(n->ps->loop, &n->req, on_name_resolved, n->host, n->port, &hints);
    if (rc != 0) {
        sp_warn(PEER, "peers_dns %s: %s", n->host, uv_strerror(rc));
        return;
    }
    n->resolving = true;
}

/* ================================================================ secrets */

/*
 * Reads the secret of `option` from path into *sec when the file is not what
 * it was when last looked at (its inode, size and change time). A next
 * secret's file may be absent or empty: there is none then. A file that does
 * not read leaves the secret as it was (logged, once per change of the file).
 * Returns -1 when it did not read, or a current secret's file is absent.
 */
static int secret_refresh(sp_peer_secret_t *sec, const char *path, const char *option, bool next)
{
    struct stat st;
    bool present = stat(path, &st) == 0;
    uint64_t mtime = present ? (uint64_t)st.st_mtim.tv_sec * 1000000000u + (uint64_t)st.st_mtim.tv_nsec : 0;
    uint64_t ino = present ? (uint64_t)st.st_ino : 0, size = present ? (uint64_t)st.st_size : 0;
    if (sec->looked && sec->mtime_ns == mtime && sec->ino == ino && sec->size == size)
        return 0;
    bool first = !sec->looked;
    sec->looked = true;
    sec->mtime_ns = mtime;
    sec->ino = ino;
    sec->size = size;
    if (next && size == 0) {
        if (sec->len > 0)
            sp_info(PEER, "%s %s is %s: only the current secret is accepted now", option, path,
                    present ? "empty" : "gone");
        sodium_memzero(sec, offsetof(sp_peer_secret_t, looked));
        return 0;
    }
    uint8_t bytes[SP_PEER_SECRET_MAX];
    size_t len;
    if (sp_peer_read_secret(path, option, bytes, &len) != 0) {
        if (!first)
            sp_warn(PEER, "%s: keeping secret %s", option, sec->len > 0 ? sec->id : "(none)");
        return -1;
    }
    memcpy(sec->bytes, bytes, len);
    sec->len = len;
    sodium_memzero(bytes, sizeof bytes);
    sp_peer_secret_id(sec->bytes, sec->len, sec->id);
    sp_info(PEER, "%s %s: secret %s%s", option, path, sec->id, first ? "" : " (read again: the file changed)");
    return 0;
}

/* Both secrets, from their files as they are now. -1 when the current one did not read. */
static int secrets_refresh(sp_peers_t *ps)
{
    int rc = secret_refresh(&ps->secret, ps->cfg->cluster_secret_file, "cluster_secret_file", false);
    if (ps->cfg->cluster_secret_next_file[0] != '\0' &&
        secret_refresh(&ps->secret_next, ps->cfg->cluster_secret_next_file, "cluster_secret_next_file", true) != 0)
        rc = -1;
    return rc;
}

void sp_peers_awake(sp_peers_t *ps, uint64_t now)
{
    /* The tick runs every heartbeat: later than two, spd was held. */
    uint64_t beat = (uint64_t)ps->cfg->peer_heartbeat_ms * 1000000u;
    uint64_t held = ps->ran_ns != 0 && now - ps->ran_ns > 2 * beat ? now - ps->ran_ns - beat : 0;
    ps->ran_ns = now;
    if (held == 0)
        return;
    ps->held_ns += held;
    if (held >= (uint64_t)ps->cfg->peer_timeout_ms * 1000000u / 2)
        sp_warn(PEER, "spd did not run for %" PRIu64 " ms (the machine or the scheduler held it): the peers' "
                "silence and the waits for daemons that went leave that time out", held / 1000000);
    if (ps->on_held != NULL)
        ps->on_held(ps->hook_arg, held);
}

/* How long p has been silent, leaving out the time spd was held since. */
static uint64_t peer_silence(const sp_peer_t *p, uint64_t now)
{
    uint64_t held = p->ps->held_ns - p->held_at_heard;
    return now - p->heard_ns > held ? now - p->heard_ns - held : 0;
}

static void on_tick(uv_timer_t *t)
{
    sp_peers_t *ps = t->data;
    uint64_t now = sp_now_ns();
    uint64_t timeout = (uint64_t)ps->cfg->peer_timeout_ms * 1000000u;
    char detail[192];

    sp_peers_awake(ps, now);
    secrets_refresh(ps);   /* a rotation takes effect for the links made from now on */
    if (ps->names != NULL && now >= ps->names_next_ns) {
        for (sp_peer_name_t *n = ps->names; n != NULL; n = n->next)
            name_resolve(n);
        ps->names_next_ns = now + (uint64_t)ps->cfg->peers_dns_interval_ms * 1000000u;
    }
    if (ps->closed_at_accept != ps->closed_logged) {
        sp_warn(PEER, "closed %" PRIu64 " peer connection(s) at accept: %s", ps->closed_at_accept - ps->closed_logged,
                ps->closed_why);
        ps->closed_logged = ps->closed_at_accept;
    }

    for (sp_peer_t *p = ps->list, *next; p != NULL; p = next) {
        next = p->next;   /* peer_down may free p */
        switch (p->state) {
        case SP_PEER_CONNECTING:
        case SP_PEER_AUTH:
            if (now - p->since_ns > (uint64_t)PEER_AUTH_TIMEOUT_MS * 1000000u) {
                snprintf(detail, sizeof detail, "not authenticated within %d ms", PEER_AUTH_TIMEOUT_MS);
                peer_down(p, SP_PEER_DOWN, detail);
            }
            break;
        case SP_PEER_UP:
            if (peer_silence(p, now) > timeout) {
                snprintf(detail, sizeof detail, "nothing heard for %" PRId64 " ms (peer_timeout_ms)",
                         ps->cfg->peer_timeout_ms);
                peer_down(p, SP_PEER_DOWN, detail);
            } else {
                send_beat(p->link, ++p->beat_seq, now, false);
            }
            break;
        case SP_PEER_DOWN:
        case SP_PEER_REFUSED:
            if (p->outbound && !p->self && now >= p->next_dial_ns)
                peer_dial(p);
            break;
        }
    }
}

/* ================================================================ setup */

static int peers_listen(sp_peers_t *ps, const char *addr)
{
    char host[80], port[16];
    struct sockaddr_storage sa;
    if (split_addr(addr, host, sizeof host, port, sizeof port) != 0 ||
        (uv_ip4_addr(host, atoi(port), (struct sockaddr_in *)&sa) != 0 &&
         uv_ip6_addr(host, atoi(port), (struct sockaddr_in6 *)&sa) != 0)) {
        sp_error(CFG, "peer_listen '%s': give a numeric address and a port (127.0.0.1:7420, [::1]:7420)", addr);
        return -1;
    }
    uv_tcp_init(ps->loop, &ps->listener);
    ps->listener.data = ps;
    int rc = uv_tcp_bind(&ps->listener, (struct sockaddr *)&sa, 0);
    if (rc == 0)
        rc = uv_listen((uv_stream_t *)&ps->listener, 64, on_connection);
    if (rc != 0) {
        sp_error(PEER, "cannot listen on %s: %s", addr, uv_strerror(rc));
        uv_close((uv_handle_t *)&ps->listener, NULL);
        return -1;
    }
    ps->listening = true;
    int len = sizeof sa;
    uv_tcp_getsockname(&ps->listener, (struct sockaddr *)&sa, &len);
    sp_addr_name(&sa, NULL, 0, ps->listen_addr, sizeof ps->listen_addr);
    sp_info(PEER, "listening for peers on %s", ps->listen_addr);
    return 0;
}

static int peers_add(sp_peers_t *ps, const char *list)
{
    const char *s = list;
    while (*s != '\0') {
        size_t n = strcspn(s, ",");
        char addr[96], host[80], port[16];
        while (n > 0 && (*s == ' ' || *s == '\t')) {
            s++;
            n--;
        }
        if (n >= sizeof addr || (snprintf(addr, sizeof addr, "%.*s", (int)n, s),
                                 split_addr(addr, host, sizeof host, port, sizeof port) != 0)) {
            sp_error(CFG, "peers: '%.*s' is not host:port", (int)n, s);
            return -1;
        }
        if (peer_outbound_new(ps, addr) == NULL)
            return -1;
        s += n;
        if (*s == ',')
            s++;
    }
    return 0;
}

/* The names of peers_dns, a comma list of host:port. */
static int names_add(sp_peers_t *ps, const char *list)
{
    sp_peer_name_t **tail = &ps->names;
    for (const char *s = list; *s != '\0';) {
        size_t n = strcspn(s, ",");
        char addr[96];
        while (n > 0 && (*s == ' ' || *s == '\t')) {
            s++;
            n--;
        }
        sp_peer_name_t *nm = calloc(1, sizeof *nm);
        if (nm == NULL)
            return -1;
        *tail = nm;
        tail = &nm->next;
        nm->ps = ps;
        if (n >= sizeof addr || (snprintf(addr, sizeof addr, "%.*s", (int)n, s),
                                 split_addr(addr, nm->host, sizeof nm->host, nm->port, sizeof nm->port) != 0)) {
            sp_error(CFG, "peers_dns: '%.*s' is not name:port", (int)n, s);
            return -1;
        }
        s += n;
        if (*s == ',')
            s++;
    }
    return 0;
}

int sp_peers_init(sp_peers_t *ps, uv_loop_t *loop, const sp_config_t *cfg, const char *node)
{
    memset(ps, 0, sizeof *ps);
    ps->loop = loop;
    ps->cfg = cfg;
    snprintf(ps->node, sizeof ps->node, "%s", node);
    if (cfg->peer_listen[0] == '\0' && cfg->peers[0] == '\0' && cfg->peers_dns[0] == '\0')
        return 0;
    ps->enabled = true;
    if (sodium_init() < 0) {
        sp_error(PEER, "libsodium did not initialise");
        return -1;
    }
    randombytes_buf(&ps->incarnation, sizeof ps->incarnation);
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY)
        ps->fd_limit = (int64_t)rl.rlim_cur;
    if (cfg->cluster_secret_file[0] == '\0') {
        sp_error(CFG, "peer_listen, peers and peers_dns need cluster_secret_file: daemons prove to each other "
                 "that they share its secret");
        return -1;
    }
    if (secrets_refresh(ps) != 0 || ps->secret.len == 0)
        goto fail;
    if (cfg->peer_listen[0] != '\0' && peers_listen(ps, cfg->peer_listen) != 0)
        goto fail;
    if (peers_add(ps, cfg->peers) != 0 || names_add(ps, cfg->peers_dns) != 0)
        goto fail;
    uv_timer_init(loop, &ps->tick);
    ps->tick.data = ps;
    ps->tick_started = true;
    uv_timer_start(&ps->tick, on_tick, 0, (uint64_t)cfg->peer_heartbeat_ms);
    return 0;

fail:
    sp_peers_close(ps);
    return -1;
}

static void on_closed_noop(uv_handle_t *h)
{
    (void)h;
}

void sp_peers_close(sp_peers_t *ps)
{
    if (ps->closing)
        return;
    ps->closing = true;
    if (ps->listening) {
        uv_close((uv_handle_t *)&ps->listener, on_closed_noop);
        ps->listening = false;
    }
    if (ps->tick_started) {
        uv_close((uv_handle_t *)&ps->tick, on_closed_noop);
        ps->tick_started = false;
    }
    while (ps->list != NULL) {
        sp_peer_t *p = ps->list;
        ps->list = p->next;
        if (p->link != NULL)
            link_close(p->link);
        free(p);
    }
    while (ps->names != NULL) {
        sp_peer_name_t *n = ps->names;
        ps->names = n->next;
        n->ps = NULL;
        if (n->resolving)
            uv_cancel((uv_req_t *)&n->req);   /* its callback frees it */
        else
            free(n);
    }
    sodium_memzero(&ps->secret, sizeof ps->secret);
    sodium_memzero(&ps->secret_next, sizeof ps->secret_next);
}

void sp_peers_foreach(const sp_peers_t *ps, void (*fn)(void *arg, const sp_peer_info_t *p), void *arg)
{
    uint64_t now = sp_now_ns();
    for (const sp_peer_t *p = ps->list; p != NULL; p = p->next) {
        sp_peer_info_t i = {
            .node = p->node, .addr = p->addr, .dns_name = p->name != NULL ? p->name->host : "",
            .outbound = p->outbound, .state = p->state, .why = p->why,
            .since_s = (double)(now - p->since_ns) / 1e9,
            .heard_ms = p->heard_ns ? (double)(now - p->heard_ns) / 1e6 : -1,
            .rtt_us = p->rtt_ns ? (double)p->rtt_ns / 1e3 : -1, .protocol = p->protocol, .dials = p->dials,
            .redial_s = p->outbound && (p->state == SP_PEER_DOWN || p->state == SP_PEER_REFUSED)
                            ? (double)(p->next_dial_ns > now ? p->next_dial_ns - now : 0) / 1e9 : -1,
        };
        fn(arg, &i);
    }
}

bool sp_peers_is_up(const sp_peers_t *ps, const char *node)
{
    for (const sp_peer_t *p = ps->list; p != NULL; p = p->next)
        if (p->state == SP_PEER_UP && strcmp(p->node, node) == 0)
            return true;
    return false;
}

int sp_peers_send(sp_peers_t *ps, const char *node, const Spd__Msg *msg)
{
    for (sp_peer_t *p = ps->list; p != NULL; p = p->next)
        if (p->state == SP_PEER_UP && strcmp(p->node, node) == 0)
            return link_send(p->link, msg);
    return -1;
}

void sp_peers_drop(sp_peers_t *ps, const char *node, const char *why)
{
    for (sp_peer_t *p = ps->list, *next; p != NULL; p = next) {
        next = p->next;   /* peer_down may free p */
        if (p->link != NULL && strcmp(p->node, node) == 0)
            peer_down(p, SP_PEER_DOWN, why);
    }
}

uint32_t sp_peers_up(const sp_peers_t *ps)
{
    uint32_t n = 0;
    for (const sp_peer_t *p = ps->list; p != NULL; p = p->next)
        n += p->state == SP_PEER_UP;
    return n;
}
