/*
 * cluster_names.c — named jobs across daemons: which daemon of the cluster is
 * the home of a name, found with no id passed between the ranks.
 *
 * A named job ("uid/name", spc_job_join_named) lives on its home: the daemon
 * where its rank 0 joined. A join of a name this daemon holds (its home, or a
 * mirror of a home elsewhere) is joined at once, as on one node. Otherwise the
 * join waits here in a lookup, which asks every daemon with a link up whether
 * it is the name's home (PeerNameQuery, spd.proto) and decides once all of
 * them have answered, or once name_lookup_ms has passed with what came:
 *
 *   - a home of the join's launch: a mirror of the job is made here and the
 *     join goes there, as any join of a job rooted on another daemon does
 *     (cluster_jobs.c); the home checks the uid and the launch again;
 *   - a home of another launch: refused, as a reuse of the name is on one node;
 *   - two homes: refused, naming both, rather than a job split in two;
 *   - none: rank 0 makes the job here, and the lookups of that name waiting
 *     here join it at once; another rank asks again, round after round, until
 *     its join's deadline.
 *
 * A daemon that made a home tells the linked daemons so, unasked (round 0):
 * their lookups of that name, which heard "not here" before, ask again at once
 * instead of a round later. That word moves nothing by itself; only answers
 * to a round decide.
 *
 * Every lookup asks on its own, so they stay independent of one another; at
 * most max_name_lookups wait at once, each asking once a round. A query from
 * another daemon is answered at once from the job table and keeps nothing. An
 * answer is another daemon's word: one for a round nobody asked, from a
 * daemon not asked, a second one, or one that cannot describe a job is
 * logged and left out.
 */
#include "ctl/cluster_names.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "ctl/cluster_jobs.h"
#include "core/engine.h"
#include "core/job.h"
#include "sp_msg.h"

/* Daemons with a link up, each once. */
typedef struct up_nodes {
    char   (*node)[SP_NODE_MAX];
    uint32_t n, cap;
    bool     short_of_memory;
} up_nodes_t;

/* Adds a daemon whose link is up to the list, once (sp_peers_foreach). */
static void up_add(void *arg, const sp_peer_info_t *p)
{
    up_nodes_t *u = arg;
    if (p->state != SP_PEER_UP || p->node[0] == '\0')
        return;
    for (uint32_t i = 0; i < u->n; i++)
        if (strcmp(u->node[i], p->node) == 0)
            return;
    if (u->n == u->cap) {
        uint32_t cap = u->cap ? u->cap * 2 : 8;
        char (*n)[SP_NODE_MAX] = realloc(u->node, cap * sizeof *n);
        if (n == NULL) {
            u->short_of_memory = true;
            return;
        }
        u->node = n;
        u->cap = cap;
    }
    snprintf(u->node[u->n++], SP_NODE_MAX, "%s", p->node);
}

/* Lists the daemons whose link is up now (u->node kept for reuse). */
static void up_list(sp_server_t *srv, up_nodes_t *u)
{
    u->n = 0;
    u->short_of_memory = false;
    sp_peers_foreach(&srv->peers, up_add, u);
    if (u->short_of_memory)
        sp_warn(PEER, "out of memory listing the linked daemons; taking %u of them", u->n);
}

/* Sends msg to each of them; one whose link went meanwhile is blanked, as no
 * answer will come from it. */
static void up_send(sp_server_t *srv, up_nodes_t *u, const Spd__Msg *msg)
{
    for (uint32_t i = 0; i < u->n; i++)
        if (sp_peers_send(&srv->peers, u->node[i], msg) != 0)
            u->node[i][0] = '\0';   /* its link went: no answer will come */
}

struct sp_name_lookup {
    sp_name_lookup_t *next;                      /* srv->lookups */
    sp_session_t     *s;                         /* the join that waits */
    uint32_t          seq, world_size, rank;
    char              name[SP_JOB_NAME_MAX];
    char              launch[SP_JOB_LAUNCH_MAX];
    char              bus[SP_TOPO_BUS_MAX];
    uint64_t          round;                     /* the round asked: answers to another are stale */
    uint64_t          asked_ns;
    uint32_t          rounds;
    bool              decided;                   /* this round's answers are all in, or its time is up */
    bool              hinted;                    /* a daemon became the home during the round: ask again */
    up_nodes_t        asked;                     /* the daemons asked this round; "" once one answered */
    uint32_t          nanswered;
    /* What this round's answers said. */
    uint32_t          nhomes;                    /* homes of the join's launch */
    char              home[2][SP_NODE_MAX];
    char              other[SP_NODE_MAX];        /* a home of another launch; "": none */
    char              other_launch[SP_JOB_LAUNCH_MAX];
    uint32_t          other_joined, other_world;
    bool              other_complete;
};

static void lookup_free(sp_server_t *srv, sp_name_lookup_t *l)
{
    sp_name_lookup_t **pp = &srv->lookups;
    while (*pp != l)
        pp = &(*pp)->next;
    *pp = l->next;
    srv->nlookups--;
    l->s->join_lookup = NULL;
    free(l->asked.node);
    free(l);
    if (srv->lookups == NULL)
        uv_timer_stop(&srv->lookup_tick);
}

/* ---------------------------------------------------------------- deciding */

/* This daemon just became the home of uid's `name`: the linked daemons whose
 * lookups of it asked before need not wait for their next round. */
static void names_tell_home(sp_server_t *srv, uid_t uid, const char *name, const char *launch)
{
    up_nodes_t u = { 0 };
    up_list(srv, &u);
    Spd__Msg msg = SPD__MSG__INIT;
    Spd__PeerNameRep rep = SPD__PEER_NAME_REP__INIT;
    rep.uid = uid;
    rep.name = (char *)name;
    rep.held = true;
    rep.launch = (char *)launch;
    msg.body_case = SPD__MSG__BODY_PEER_NAME_REP;
    msg.peer_name_rep = &rep;
    up_send(srv, &u, &msg);
    free(u.node);
}

static spc_status_t refuse_other_launch(const sp_name_lookup_t *l, const char *id, sp_err_t *e)
{
    char also[SP_NODE_MAX + 96] = "";
    if (l->nhomes > 0)
        snprintf(also, sizeof also, " (node %s holds it for this launch too: two launches took the name at once)",
                 l->home[0]);
    return sp_err_set(e, SPC_ERR_BUSY, "job %s is held by another launch (%.100s, %u of %u ranks joined%s) on node "
                      "%s%s; this rank's launch is %.100s: choose another name (SPC_JOB) or wait until it ends", id,
                      l->other_launch, l->other_joined, l->other_world, l->other_complete ? ", running" : "",
                      l->other, also, l->launch);
}

static spc_status_t refuse_two_homes(const sp_name_lookup_t *l, const char *id, sp_err_t *e)
{
    return sp_err_set(e, SPC_ERR_BUSY, "job %s has two homes, node %s and node %s, both for launch %.100s (two "
                      "ranks 0 joined at once on daemons that could not see each other): refused rather than split "
                      "in two; end the launch and start it again", id, l->home[0], l->home[1], l->launch);
}

static bool lookup_decide(sp_server_t *srv, sp_name_lookup_t *l);

/* Rank 0 made the job here: the joins of its name that wait here take it now. */
static void lookups_settle_name(sp_server_t *srv, uid_t uid, const char *name)
{
    sp_name_lookup_t *l = srv->lookups;
    while (l != NULL) {
        if (l->s->uid != uid || strcmp(l->name, name) != 0) {
            l = l->next;
            continue;
        }
        if (!lookup_decide(srv, l)) {   /* the job went again at once: asks next round */
            l = l->next;
            continue;
        }
        l = srv->lookups;   /* l is gone, and deciding may have settled others too */
    }
}

/* Decides the lookup's round: the join is settled (true: l is gone, the
 * session answered or waiting on its job) or, while rank 0 has not joined
 * anywhere, left for the next round (false). Lock not held. */
static bool lookup_decide(sp_server_t *srv, sp_name_lookup_t *l)
{
    sp_engine_t *eng = srv->eng;
    sp_session_t *s = l->s;
    sp_err_t e = SP_ERR_INIT;
    char id[SP_JOB_ID_MAX];
    spc_status_t st = SPC_OK;

    l->decided = true;
    sp_job_named_id(s->uid, l->name, id);
    pthread_mutex_lock(&eng->lock);
    bool here = sp_job_find(eng, id) != NULL;
    bool makes = !here && l->other[0] == '\0' && l->nhomes == 0;
    if (makes && l->rank != 0) {
        pthread_mutex_unlock(&eng->lock);
        return false;
    }
    if (!here && l->other[0] != '\0')
        st = refuse_other_launch(l, id, &e);
    else if (!here && l->nhomes > 1)
        st = refuse_two_homes(l, id, &e);
    else if (!here && l->nhomes == 1)
        st = sp_job_mirror_named(eng, s->uid, l->name, l->launch, l->home[0], &e);
    const sp_name_lookup_t done = *l;   /* what the join needs, l being gone */
    lookup_free(srv, l);

    sp_job_t *job = NULL;
    bool complete = false;
    if (st == SPC_OK)
        st = sp_job_join_named(eng, s->client, done.name, done.launch, done.world_size, done.rank, s, &job,
                               &complete, &e);
    if (st == SPC_OK && makes)
        sp_info(JOB, "job %s: its home is here, where rank 0 joined (%u daemon%s asked, %u answered)", id,
                done.asked.n, done.asked.n == 1 ? "" : "s", done.nanswered);
    st = sp_joins_settle(s, done.seq, done.rank, done.bus, st, job, complete, &e);   /* unlocks */
    if (st != SPC_OK) {
        sp_warn(JOB, "pid %d (uid %u) refused: %s", (int)s->pid, (unsigned)s->uid, e.msg);
        s->join_active = false;
        s->join_job = NULL;
        uv_timer_stop(&s->timer);
        sp_session_reply_err(s, done.seq, &e);
        return true;
    }
    if (makes) {
        names_tell_home(srv, s->uid, done.name, done.launch);
        lookups_settle_name(srv, s->uid, done.name);
    }
    return true;
}

/* ---------------------------------------------------------------- asking */

/* Starts a round: asks every daemon with a link up whether it is the name's
 * home. With nobody to ask the round is decided at once. */
static void lookup_ask(sp_server_t *srv, sp_name_lookup_t *l)
{
    l->round = ++srv->lookup_round;
    l->asked_ns = sp_now_ns();
    l->rounds++;
    l->decided = l->hinted = false;
    l->nanswered = l->nhomes = 0;
    l->other[0] = '\0';
    up_list(srv, &l->asked);

    Spd__Msg msg = SPD__MSG__INIT;
    Spd__PeerNameQuery q = SPD__PEER_NAME_QUERY__INIT;
    q.round = l->round;
    q.uid = l->s->uid;
    q.name = l->name;
    msg.body_case = SPD__MSG__BODY_PEER_NAME_QUERY;
    msg.peer_name_query = &q;
    up_send(srv, &l->asked, &msg);
    if (l->asked.n == 0)
        lookup_decide(srv, l);
}

/* Every tick: rounds that had their time are decided with what came, and the
 * lookups still waiting ask again. */
static void on_lookup_tick(uv_timer_t *t)
{
    sp_server_t *srv = t->data;
    uint64_t now = sp_now_ns(), round_ns = (uint64_t)srv->cfg->name_lookup_ms * 1000000u;
    uint64_t last = srv->lookup_round;   /* rounds asked during this tick are not due */
    sp_name_lookup_t *l = srv->lookups;
    while (l != NULL) {
        if (l->round > last || now - l->asked_ns < round_ns) {
            l = l->next;
            continue;
        }
        if (!l->decided && lookup_decide(srv, l)) {
            l = srv->lookups;   /* l is gone, and maybe others with it */
            continue;
        }
        lookup_ask(srv, l);     /* may decide and free it at once */
        l = srv->lookups;
    }
}

/* ---------------------------------------------------------------- the join, the answers */

bool sp_names_must_look(sp_server_t *srv, uid_t uid, const char *name)
{
    char id[SP_JOB_ID_MAX];
    if (sp_job_name_problem(name) != NULL)
        return false;   /* refused where every named join is checked */
    sp_job_named_id(uid, name, id);
    return sp_job_find(srv->eng, id) == NULL;
}

void sp_names_join(sp_session_t *s, uint32_t seq, const Spd__JobJoinReq *r, const char *bus)
{
    sp_server_t *srv = s->srv;
    sp_err_t e = SP_ERR_INIT;

    pthread_mutex_lock(&srv->eng->lock);
    spc_status_t st = sp_job_named_check(s->client, r->name, r->launch, r->world_size, r->rank, &e);
    pthread_mutex_unlock(&srv->eng->lock);
    if (st == SPC_OK && srv->nlookups >= (uint64_t)srv->cfg->max_name_lookups)
        st = sp_err_set(&e, SPC_ERR_LIMIT, "%u named joins already wait to learn which daemon is their job's home "
                        "(max_name_lookups); this one is refused until one of them ends", srv->nlookups);
    sp_name_lookup_t *l = st == SPC_OK ? calloc(1, sizeof *l) : NULL;
    if (st == SPC_OK && l == NULL)
        st = sp_err_set(&e, SPC_ERR_NO_MEMORY, "out of memory");
    if (st != SPC_OK) {
        sp_warn(JOB, "pid %d (uid %u) refused: %s", (int)s->pid, (unsigned)s->uid, e.msg);
        sp_session_reply_err(s, seq, &e);
        return;
    }
    *l = (sp_name_lookup_t){ .next = srv->lookups, .s = s, .seq = seq, .world_size = r->world_size,
                             .rank = r->rank };
    snprintf(l->name, sizeof l->name, "%s", r->name);
    snprintf(l->launch, sizeof l->launch, "%s", r->launch);
    snprintf(l->bus, sizeof l->bus, "%s", bus);
    srv->lookups = l;
    if (srv->nlookups++ == 0) {
        uint64_t every = (uint64_t)srv->cfg->name_lookup_ms / 2 + 1;
        uv_timer_start(&srv->lookup_tick, on_lookup_tick, every, every);
    }
    s->join_active = true;
    s->join_seq = seq;
    s->join_rank = r->rank;
    s->join_job = NULL;
    s->join_lookup = l;
    sp_joins_arm(s, r->timeout_ms ? r->timeout_ms : (uint64_t)srv->cfg->op_timeout_ms);
    sp_debug(JOB, "pid %d: rank %u of job %u/%s looks for its home", (int)s->pid, r->rank, (unsigned)s->uid, r->name);
    lookup_ask(srv, l);
}

void sp_names_answer(sp_server_t *srv, const char *node, const Spd__PeerNameQuery *q)
{
    char id[SP_JOB_ID_MAX];
    const char *bad = sp_job_name_problem(q->name);
    if (bad != NULL) {
        sp_warn(PEER, "node %s: asks where a job lives by a name that %s: not answered", node, bad);
        return;
    }
    sp_job_named_id(q->uid, q->name, id);
    const sp_job_t *job = sp_job_find(srv->eng, id);
    Spd__Msg msg = SPD__MSG__INIT;
    Spd__PeerNameRep rep = SPD__PEER_NAME_REP__INIT;
    rep.round = q->round;
    rep.uid = q->uid;
    rep.name = q->name;
    rep.held = job != NULL && job->named && !job->mirror;
    if (rep.held) {
        rep.launch = (char *)job->launch;
        rep.world_size = job->world_size;
        rep.joined = job->joined;
        rep.complete = job->complete;
    }
    msg.body_case = SPD__MSG__BODY_PEER_NAME_REP;
    msg.peer_name_rep = &rep;
    sp_peers_send(&srv->peers, node, &msg);
}

/* The index of `node` among the daemons the round asked that have not
 * answered yet; UINT32_MAX when it was not asked, or answered already. */
static uint32_t asked_index(const sp_name_lookup_t *l, const char *node)
{
    for (uint32_t i = 0; i < l->asked.n; i++)
        if (l->asked.node[i][0] != '\0' && strcmp(l->asked.node[i], node) == 0)
            return i;
    return UINT32_MAX;
}

/* Daemon `node` says it just became the home of uid's `name`: the lookups of
 * that name whose round is decided ask again now, those still asking once
 * their round is. Its word counts for nothing more: the answers decide. */
static void names_home_made(sp_server_t *srv, const char *node, const Spd__PeerNameRep *rep)
{
    const char *bad = sp_job_name_problem(rep->name);
    if (bad != NULL || !rep->held) {
        sp_warn(PEER, "node %s: says it became the home of a job whose name %s: left out", node,
                bad != NULL ? bad : "it does not hold");
        return;
    }
    uint64_t last = srv->lookup_round;   /* rounds asked from here on are new */
    sp_name_lookup_t *l = srv->lookups;
    while (l != NULL) {
        if (l->round > last || l->s->uid != rep->uid || strcmp(l->name, rep->name) != 0) {
            l = l->next;
            continue;
        }
        if (!l->decided) {
            l->hinted = true;
            l = l->next;
            continue;
        }
        lookup_ask(srv, l);   /* may decide and free it at once */
        l = srv->lookups;
    }
}

void sp_names_heard(sp_server_t *srv, const char *node, const Spd__PeerNameRep *rep)
{
    if (rep->round == 0) {
        names_home_made(srv, node, rep);
        return;
    }
    sp_name_lookup_t *l = srv->lookups;
    while (l != NULL && l->round != rep->round)
        l = l->next;
    if (l == NULL || l->decided) {   /* decided without it, or the join went */
        sp_debug(PEER, "node %s: an answer to name round %" PRIu64 ", which nobody waits for", node, rep->round);
        return;
    }
    uint32_t i = asked_index(l, node);
    if (rep->uid != l->s->uid || strcmp(rep->name, l->name) != 0 || i == UINT32_MAX) {
        sp_warn(PEER, "node %s: an answer to name round %" PRIu64 " about job %u/%.64s, but it was asked about %u/%s "
                "%s: left out", node, rep->round, rep->uid, rep->name, (unsigned)l->s->uid, l->name,
                i == UINT32_MAX ? "(or not asked, or answered already)" : "");
        return;
    }
    l->asked.node[i][0] = '\0';
    l->nanswered++;
    if (rep->held) {
        const char *bad = sp_job_launch_problem(rep->launch);
        if (bad != NULL || rep->world_size > SP_MAX_WORLD || rep->joined > rep->world_size) {
            sp_warn(PEER, "node %s: says it is the home of job %u/%s with %u of %u ranks joined, launch '%.*s'%s%s, "
                    "which no job can be: taken as not holding it", node, (unsigned)l->s->uid, l->name,
                    rep->joined, rep->world_size,
                    (int)sp_job_text_plain(rep->launch, SP_JOB_LAUNCH_MAX - 1, SP_JOB_LAUNCH_CHARS), rep->launch,
                    bad != NULL ? ", which " : "", bad != NULL ? bad : "");
        } else if (strcmp(rep->launch, l->launch) == 0) {
            snprintf(l->home[l->nhomes < 2 ? l->nhomes : 1], SP_NODE_MAX, "%s", node);
            l->nhomes++;
        } else {
            snprintf(l->other, sizeof l->other, "%s", node);
            snprintf(l->other_launch, sizeof l->other_launch, "%s", rep->launch);
            l->other_joined = rep->joined;
            l->other_world = rep->world_size;
            l->other_complete = rep->complete;
        }
    }
    if (l->nanswered == l->asked.n && !lookup_decide(srv, l) && l->hinted)
        lookup_ask(srv, l);   /* a home was made while it asked */
}

void sp_names_expired(sp_session_t *s, char *detail, size_t len)
{
    sp_name_lookup_t *l = s->join_lookup;
    snprintf(detail, len, "no daemon is the home of job %u/%s yet: its rank 0 has not joined on this daemon or one "
             "linked to it (asked %u round%s, %u of %u daemons answered the last); rank %u of %u waited here",
             (unsigned)s->uid, l->name, l->rounds, l->rounds == 1 ? "" : "s", l->nanswered, l->asked.n, l->rank,
             l->world_size);
    lookup_free(s->srv, l);
}

void sp_names_forget(sp_session_t *s)
{
    lookup_free(s->srv, s->join_lookup);
}

void sp_names_init(sp_server_t *srv)
{
    uv_timer_init(srv->loop, &srv->lookup_tick);
    srv->lookup_tick.data = srv;
    srv->lookup_clock = true;
}

static void on_tick_closed(uv_handle_t *h)
{
    (void)h;
}

void sp_names_close(sp_server_t *srv)
{
    if (!srv->lookup_clock)
        return;
    uv_close((uv_handle_t *)&srv->lookup_tick, on_tick_closed);
    srv->lookup_clock = false;
}
