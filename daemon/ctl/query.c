/*
 * query.c — the answers to spctl: one QueryRep per question, records of typed
 * fields, for the topics status, clients, config, jobs, mesh, ops, peers, topo,
 * stats, history and metrics.
 *
 * Each topic reads what it needs under the engine lock (the larger answers copy
 * it out and build their records with the lock dropped). An unknown topic, job
 * or option is SPC_ERR_NOT_FOUND, an answer that ran out of memory
 * SPC_ERR_NO_MEMORY. A user that shares spd through allow_group sees its own
 * clients and jobs only.
 */
#include "ctl/query.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cluster/net.h"
#include "cluster/sp_nccl.h"
#include "core/auth.h"
#include "core/client.h"
#include "core/coll.h"
#include "core/engine.h"
#include "core/job.h"
#include "core/mesh.h"
#include "core/ops.h"
#include "gpu/gpu.h"
#include "gpu/stream.h"
#include "obs/metrics.h"
#include "sp_msg.h"
#include "sp_topo.h"
#include "version.h"

/* Builds a QueryRep: records of typed fields. Everything is freed by qb_free. */
typedef struct qb {
    Spd__QueryRep rep;
    size_t cap;
    bool oom;
} qb_t;

static void qb_record(qb_t *q)
{
    if (q->rep.n_records == q->cap) {
        size_t cap = q->cap ? q->cap * 2 : 8;
        Spd__Record **r = realloc(q->rep.records, cap * sizeof *r);
        if (r == NULL) {
            q->oom = true;
            return;
        }
        q->rep.records = r;
        q->cap = cap;
    }
    Spd__Record *rec = calloc(1, sizeof *rec);
    if (rec == NULL) {
        q->oom = true;
        return;
    }
    spd__record__init(rec);
    q->rep.records[q->rep.n_records++] = rec;
}

static Spd__Field *qb_field(qb_t *q, const char *key)
{
    if (q->oom || q->rep.n_records == 0)
        return NULL;
    Spd__Record *rec = q->rep.records[q->rep.n_records - 1];
    Spd__Field **f = realloc(rec->fields, (rec->n_fields + 1) * sizeof *f);
    if (f == NULL) {
        q->oom = true;
        return NULL;
    }
    rec->fields = f;
    Spd__Field *fl = calloc(1, sizeof *fl);
    if (fl != NULL) {
        spd__field__init(fl);
        fl->key = strdup(key);
    }
    if (fl == NULL || fl->key == NULL) {
        free(fl);
        q->oom = true;
        return NULL;
    }
    rec->fields[rec->n_fields++] = fl;
    return fl;
}

static void qb_str(qb_t *q, const char *key, const char *v)
{
    Spd__Field *f = qb_field(q, key);
    if (f == NULL)
        return;
    f->value_case = SPD__FIELD__VALUE_S;
    f->s = strdup(v ? v : "");
    if (f->s == NULL)
        q->oom = true;
}

static void qb_int(qb_t *q, const char *key, int64_t v)
{
    Spd__Field *f = qb_field(q, key);
    if (f == NULL)
        return;
    f->value_case = SPD__FIELD__VALUE_I;
    f->i = v;
}

static void qb_double(qb_t *q, const char *key, double v)
{
    Spd__Field *f = qb_field(q, key);
    if (f == NULL)
        return;
    f->value_case = SPD__FIELD__VALUE_D;
    f->d = v;
}

static void qb_free(qb_t *q)
{
    for (size_t i = 0; i < q->rep.n_records; i++) {
        Spd__Record *rec = q->rep.records[i];
        for (size_t k = 0; k < rec->n_fields; k++) {
            Spd__Field *f = rec->fields[k];
            free(f->key);
            if (f->value_case == SPD__FIELD__VALUE_S && f->s != protobuf_c_empty_string)
                free(f->s);
            free(f);
        }
        free(rec->fields);
        free(rec);
    }
    free(q->rep.records);
}

/*
 * For each ordered pair of this node's GPUs, the path an op between them takes
 * as the topology chooses it (sp_topo_p2p_route): peer access over NVLink or
 * PCIe, or staged through host memory where peer access is absent, and why.
 * The topology is set before the loop runs and never changes: no lock.
 */
static void status_gpu_paths(const sp_topo_t *topo, qb_t *q)
{
    const sp_topo_node_t *n = topo != NULL ? &topo->nodes[0] : NULL;
    uint32_t count[3] = { 0, 0, 0 };
    char key[48], why[256];
    if (n == NULL || n->ngpus < 2)
        return;
    for (uint32_t i = 0; i < n->ngpus; i++)
        for (uint32_t j = 0; j < n->ngpus; j++)
            if (i != j)
                count[sp_topo_p2p_route(n, n->gpus[i].index, n->gpus[j].index, NULL, 0)]++;
    snprintf(why, sizeof why, "chosen by the topology (spctl topo): %u pairs peer access, %u staged through host "
             "memory, %u unknown", count[SP_TOPO_ROUTE_PEER], count[SP_TOPO_ROUTE_STAGED], count[SP_TOPO_ROUTE_UNKNOWN]);
    qb_str(q, "gpu_paths", why);
    for (uint32_t i = 0; i < n->ngpus; i++) {
        for (uint32_t j = 0; j < n->ngpus; j++) {
            if (i == j)
                continue;
            sp_topo_p2p_route(n, n->gpus[i].index, n->gpus[j].index, why, sizeof why);
            snprintf(key, sizeof key, "gpu%d->gpu%d", (int)n->gpus[i].index, (int)n->gpus[j].index);
            qb_str(q, key, why);
        }
    }
}

static void query_status(sp_server_t *srv, qb_t *q)
{
    sp_engine_t *eng = srv->eng;
    uint32_t control = 0;
    for (sp_session_t *s = srv->sessions; s != NULL; s = s->next)
        control += s->state == SP_SESSION_CONTROL;

    pthread_mutex_lock(&eng->lock);
    uint32_t clients = eng->nclients, jobs = eng->njobs, inflight = sp_engine_inflight_locked(eng);
    uint64_t ops = eng->ops_total, failed = eng->ops_failed, bytes = eng->bytes_moved;
    uint64_t resumed = eng->clients_resumed;
    sp_gpu_counts_t gpu = sp_gpu_counts(eng);
    uint64_t net_dropped = sp_net_dropped(eng), kept_bytes, not_kept;
    sp_net_kept_counts(eng, &kept_bytes, &not_kept);
    pthread_mutex_unlock(&eng->lock);

    qb_record(q);
    qb_str(q, "version", SPD_VERSION);
    /* The protocols served, and how many sessions chose each (spctl clients: which). */
    qb_int(q, "protocol", srv->protocol_max);
    qb_int(q, "protocol_min", SP_PROTOCOL_MIN);
    for (uint32_t p = SP_PROTOCOL_MIN; p <= SP_PROTOCOL_VERSION; p++) {
        char key[32];
        snprintf(key, sizeof key, "protocol%u_sessions", p);
        qb_int(q, key, srv->by_protocol[p]);
    }
    qb_int(q, "peer_protocol", SP_PEER_PROTOCOL_VERSION);
    qb_int(q, "peer_protocol_min", SP_PEER_PROTOCOL_MIN);
    qb_int(q, "pid", getpid());
    qb_str(q, "node", srv->node);
    qb_str(q, "socket", srv->socket_path);
    qb_str(q, "state", srv->draining ? "draining" : "running");
    qb_double(q, "uptime_s", (double)(sp_now_ns() - srv->started_ns) / 1e9);
    qb_int(q, "clients", clients);
    qb_int(q, "clients_resumed", (int64_t)resumed);
    qb_int(q, "control_sessions", control);
    qb_int(q, "jobs", jobs);
    qb_int(q, "ops_total", (int64_t)ops);
    qb_int(q, "ops_failed", (int64_t)failed);
    qb_int(q, "ops_inflight", inflight);
    qb_int(q, "bytes_moved", (int64_t)bytes);
    qb_int(q, "copy_threads", eng->copy_threads);
    qb_str(q, "transport_shm", srv->devices.shm);
    char ucx[160];
    snprintf(ucx, sizeof ucx, "%s; %s", srv->devices.ucx,
             srv->eng->net != NULL ? "carries data between daemons" : "idle (no peers configured)");
    qb_str(q, "transport_ucx", ucx);
    char nccl[320];
    sp_nccl_status(srv->eng, srv->devices.nccl, nccl, sizeof nccl);
    sp_nccl_counts_t nk = sp_nccl_counts(srv->eng);
    qb_str(q, "transport_nccl", nccl);
    qb_int(q, "nccl_comms", nk.comms);
    qb_int(q, "nccl_ops_inflight", nk.inflight);
    /* Through a peer daemon's restart (peer_restart_grace_ms): ops held, and how each hold ended. */
    qb_int(q, "nccl_ops_held", (int64_t)nk.held);
    qb_int(q, "nccl_ops_rerun", (int64_t)nk.rerun);
    qb_int(q, "nccl_ops_held_failed", (int64_t)nk.held_failed);
    qb_int(q, "gpus", srv->devices.gpu_count);
    qb_str(q, "gpu_status", srv->devices.gpu_status);
    qb_int(q, "gpu_imports", (int64_t)gpu.imports);
    qb_int(q, "gpu_imports_total", (int64_t)gpu.imports_total);
    qb_int(q, "gpu_reimports", (int64_t)gpu.reimports);
    qb_int(q, "gpu_streams", (int64_t)gpu.streams);
    qb_int(q, "gpu_stream_ops", (int64_t)gpu.stream_ops);
    qb_int(q, "gpu_stream_timeouts", (int64_t)gpu.stream_timeouts);
    qb_int(q, "gpu_multi_ops", (int64_t)gpu.multi_ops);
    qb_int(q, "gpu_staged_ops", (int64_t)gpu.staged_ops);
    qb_int(q, "gpu_tasks", (int64_t)gpu.tasks);
    qb_int(q, "gpu_lanes", (int64_t)gpu.lanes);
    qb_int(q, "gpu_lanes_max", (int64_t)gpu.lanes_max);
    qb_int(q, "gpu_lanes_refused", (int64_t)gpu.lanes_refused);
    for (int i = 0; i < srv->devices.gpu_count && i < SP_MAX_GPUS_SHOWN; i++) {
        char key[16];
        snprintf(key, sizeof key, "gpu%d", i);
        qb_str(q, key, srv->devices.gpu_names[i]);
    }
    /* GPUs out of service (their context failed), each with why: only those. */
    qb_int(q, "gpus_failed", (int64_t)gpu.gpus_failed);
    for (int i = 0; i < srv->devices.gpu_count && i < SP_TOPO_MAX_GPUS; i++) {
        char key[24];
        snprintf(key, sizeof key, "gpu%d_fault", i);
        if (sp_gpu_fault(i) != NULL)
            qb_str(q, key, sp_gpu_fault(i));
    }
    status_gpu_paths(srv->eng->topo, q);
    qb_str(q, "config_file", srv->cfg->file);
    qb_str(q, "peer_listen", srv->peers.listen_addr);
    qb_int(q, "peers_up", sp_peers_up(&srv->peers));
    qb_int(q, "name_lookups", srv->nlookups);   /* named joins waiting to learn their job's home */
    qb_str(q, "cluster_secret_id", srv->peers.secret.id);
    qb_str(q, "cluster_secret_next_id", srv->peers.secret_next.id);
    qb_int(q, "peers_refused", (int64_t)srv->peers.refused_in);
    qb_int(q, "peers_closed_at_accept", (int64_t)srv->peers.closed_at_accept);
    qb_int(q, "peer_messages_dropped", (int64_t)net_dropped);
    /* What peer_restart_keep_bytes holds now, and what it turned away (sizing it). */
    qb_int(q, "peer_restart_kept_bytes", (int64_t)kept_bytes);
    qb_int(q, "peer_restart_not_kept", (int64_t)not_kept);
    qb_str(q, "metrics_listen", sp_metrics_http_addr(srv->metrics_http));
}

static void query_peer(void *arg, const sp_peer_info_t *p)
{
    qb_t *q = arg;
    qb_record(q);
    qb_str(q, "node", p->node);
    qb_str(q, "addr", p->addr);
    qb_str(q, "dns_name", p->dns_name);
    qb_str(q, "direction", p->outbound ? "out" : "in");
    qb_str(q, "state", sp_peer_state_name(p->state));
    qb_double(q, "since_s", p->since_s);
    qb_double(q, "heard_ms", p->heard_ms);
    qb_double(q, "rtt_us", p->rtt_us);
    qb_int(q, "protocol", p->protocol);
    qb_int(q, "dials", (int64_t)p->dials);
    qb_double(q, "redial_s", p->redial_s);
    qb_str(q, "why", p->why);
}

/* An operator sees every client; another user its own, whose jobs it may see. */
static void query_clients(sp_server_t *srv, qb_t *q, const sp_viewer_t *v)
{
    sp_engine_t *eng = srv->eng;
    uint64_t now = sp_now_ns();
    bool all = sp_auth_operator(v->self, v->uid);

    pthread_mutex_lock(&eng->lock);
    for (sp_client_t *c = eng->clients; c != NULL; c = c->next) {
        if (!all && c->uid != v->uid)
            continue;
        qb_record(q);
        qb_int(q, "id", (int64_t)c->id);
        qb_int(q, "pid", c->pid);
        qb_int(q, "uid", c->uid);
        qb_str(q, "name", c->name);
        qb_int(q, "protocol", c->protocol);
        qb_str(q, "job", c->job ? c->job->id : "");
        qb_int(q, "rank", c->job ? (int64_t)c->rank : -1);
        qb_int(q, "inflight", c->inflight);
        qb_int(q, "ops_submitted", (int64_t)c->ops_submitted);
        qb_int(q, "ops_failed", (int64_t)c->ops_failed);
        qb_int(q, "regions", c->nregions);
        qb_int(q, "registered_bytes", (int64_t)c->registered_bytes);
        qb_int(q, "device_regions", c->device_regions);
        qb_int(q, "device_bytes", (int64_t)c->device_bytes);
        qb_int(q, "segment_bytes", (int64_t)c->layout.segment_bytes);
        qb_int(q, "arena_bytes", (int64_t)c->layout.arena_bytes);
        qb_double(q, "attached_s", (double)(now - c->attached_ns) / 1e9);
    }
    pthread_mutex_unlock(&eng->lock);
}

static spc_status_t query_config(sp_server_t *srv, qb_t *q, const char *key, sp_err_t *e)
{
    size_t n;
    const sp_option_t *opts = sp_config_options(&n);
    char value[4200];
    bool found = false;

    for (size_t i = 0; i < n; i++) {
        if (key[0] != '\0' && strcmp(key, opts[i].name) != 0)
            continue;
        found = true;
        sp_config_format(srv->cfg, i, value, sizeof value);
        qb_record(q);
        qb_str(q, "name", opts[i].name);
        qb_str(q, "value", value);
        qb_str(q, "default", opts[i].def);
        qb_str(q, "source", sp_config_source_name(srv->cfg->source[i]));
        qb_str(q, "doc", opts[i].doc);
    }
    if (!found)
        return sp_err_set(e, SPC_ERR_NOT_FOUND, "no option '%s'", key);
    return SPC_OK;
}

/* ---------------------------------------------------------------- jobs, meshes, ops */

/*
 * These three answers are copied out of the engine under its lock into plain
 * rows (no pointer into engine state survives the unlock), then formatted and
 * turned into records with the lock dropped, so a query never holds up the
 * progress thread for longer than the copy.
 */

#define QUERY_TEXT_MAX 16384   /* longest list field; longer lists end in " ..." */

/* A growing string for list fields, capped at QUERY_TEXT_MAX. */
typedef struct qtext {
    char  *p;
    size_t len, cap;
    bool   cut, oom;
} qtext_t;

static void qt_add(qtext_t *t, const char *s)
{
    size_t n = strlen(s);
    if (t->cut || t->oom)
        return;
    if (t->len + n > QUERY_TEXT_MAX) {
        s = " ...";
        n = 4;
        t->cut = true;
    }
    if (t->len + n + 1 > t->cap) {
        size_t cap = t->cap ? t->cap * 2 : 256;
        while (cap < t->len + n + 1)
            cap *= 2;
        char *p = realloc(t->p, cap);
        if (p == NULL) {
            t->oom = true;
            return;
        }
        t->p = p;
        t->cap = cap;
    }
    memcpy(t->p + t->len, s, n + 1);
    t->len += n;
}

/* Adds the string as field `key` and empties the builder. */
static void qb_text(qb_t *q, const char *key, qtext_t *t)
{
    if (t->oom)
        q->oom = true;
    qb_str(q, key, t->p ? t->p : "");
    free(t->p);
    *t = (qtext_t){ 0 };
}

/* The job filter of a query: NULL for every job, else the named one, which
 * must exist and be one the viewer may see (another user's reads as absent).
 * Caller holds the lock. */
static spc_status_t query_job_filter(sp_engine_t *eng, const char *arg, const sp_viewer_t *v, sp_job_t **job_p,
                                     sp_err_t *e)
{
    *job_p = NULL;
    if (arg == NULL || arg[0] == '\0')
        return SPC_OK;
    if ((*job_p = sp_job_find(eng, arg)) == NULL || !sp_job_visible(*job_p, v))
        return sp_err_set(e, SPC_ERR_NOT_FOUND, "no job '%.128s' on this daemon", arg);
    return SPC_OK;
}

/* Whether a query lists job: the one its filter named (any when none), and
 * only where the viewer may see it. */
static bool job_shown(const sp_job_t *job, const sp_job_t *only, const sp_viewer_t *v)
{
    return (only == NULL || job == only) && sp_job_visible(job, v);
}

/* ---- jobs */

typedef struct q_job {
    char     id[SP_JOB_ID_MAX];
    uint64_t created_ns;
    uint32_t world_size, joined, groups, meshes, pending;
    int64_t  world_group;       /* -1 until the world is complete */
    int64_t  owner;             /* its uid; -1 while a mirror's root has not said */
    bool     complete;
    char     nodes[256];        /* the daemons with ranks, this one first */
    char     launch[SP_JOB_LAUNCH_MAX];   /* a named job's launch; "": an id's job */
    char     waiting[SP_NODE_MAX];        /* the daemon it waits for (peer_restart_grace_ms); "": none */
    uint64_t waiting_until_ns;
} q_job_t;

static int q_job_cmp(const void *a, const void *b)
{
    const q_job_t *x = a, *y = b;
    return x->created_ns < y->created_ns ? -1 : x->created_ns > y->created_ns;
}

/* Makes room for row n of an array of `size`-byte rows (doubling) and zeroes
 * it; false when out of memory. */
static bool rows_reserve(void **rows, size_t *cap, size_t n, size_t size)
{
    if (n == *cap) {
        size_t ncap = *cap ? *cap * 2 : 16;
        void *nr = realloc(*rows, ncap * size);
        if (nr == NULL)
            return false;
        *rows = nr;
        *cap = ncap;
    }
    memset((char *)*rows + n * size, 0, size);
    return true;
}

static spc_status_t query_jobs(sp_server_t *srv, qb_t *q, const char *arg, const sp_viewer_t *v, sp_err_t *e)
{
    sp_engine_t *eng = srv->eng;
    sp_job_t *only;
    q_job_t *rows = NULL;
    size_t n = 0;

    pthread_mutex_lock(&eng->lock);
    spc_status_t st = query_job_filter(eng, arg, v, &only, e);
    if (st == SPC_OK && eng->njobs > 0 && (rows = calloc(eng->njobs, sizeof *rows)) == NULL)
        q->oom = true;
    for (sp_job_t *job = eng->jobs; rows != NULL && job != NULL && n < eng->njobs; job = job->next) {
        if (!job_shown(job, only, v))
            continue;
        q_job_t *r = &rows[n++];
        snprintf(r->id, sizeof r->id, "%s", job->id);
        snprintf(r->launch, sizeof r->launch, "%s", job->launch);
        r->owner = job->access.known ? (int64_t)job->access.owner : -1;
        r->created_ns = job->created_ns;
        r->world_size = job->world_size;
        r->joined = job->joined;
        r->complete = job->complete;
        r->meshes = job->nmeshes;
        r->world_group = job->world != NULL ? (int64_t)job->world->id : -1;
        size_t off = 0;
        for (uint32_t k = 0; k < job->nnodes && off < sizeof r->nodes; k++)
            off += (size_t)snprintf(r->nodes + off, sizeof r->nodes - off, "%s%s", k ? "," : "", job->nodes[k]);
        const sp_node_wait_t *w = sp_job_node_wait(eng, job);
        if (w != NULL) {
            snprintf(r->waiting, sizeof r->waiting, "%s", w->node);
            r->waiting_until_ns = w->until_ns;
        }
        for (const sp_group_t *g = job->groups; g != NULL; g = g->next) {
            r->groups++;
            r->pending += sp_group_pending_ops(g);
        }
    }
    pthread_mutex_unlock(&eng->lock);

    uint64_t now = sp_now_ns();
    if (n > 1)
        qsort(rows, n, sizeof *rows, q_job_cmp);
    for (size_t i = 0; i < n; i++) {
        qb_record(q);
        qb_str(q, "id", rows[i].id);
        qb_int(q, "world_size", rows[i].world_size);
        qb_int(q, "joined", rows[i].joined);
        qb_int(q, "complete", rows[i].complete);
        qb_int(q, "world_group", rows[i].world_group);
        qb_int(q, "groups", rows[i].groups);
        qb_int(q, "meshes", rows[i].meshes);
        qb_int(q, "ops_pending", rows[i].pending);
        qb_str(q, "nodes", rows[i].nodes);
        qb_int(q, "owner_uid", rows[i].owner);
        qb_str(q, "launch", rows[i].launch);
        qb_double(q, "age_s", (double)(now - rows[i].created_ns) / 1e9);
        qb_str(q, "waiting_for", rows[i].waiting);
        qb_int(q, "waiting_left_ms",
               rows[i].waiting_until_ns > now ? (int64_t)((rows[i].waiting_until_ns - now) / 1000000) : 0);
    }
    free(rows);
    return st;
}

/* ---- meshes */

enum { Q_DP, Q_SP, Q_ULYSSES, Q_RING, Q_KINDS };
static const char *const q_kind_key[Q_KINDS] = { "dp_groups", "sp_groups", "ulysses_groups", "ring_groups" };

/* One mesh. Each kind of group partitions the world, so a kind's groups hold
 * `world` job ranks in all: group i is ranks[i * gsize ...]. */
typedef struct q_mesh {
    char      job[SP_JOB_ID_MAX];
    uint64_t  created_ns;            /* of the job, for the order */
    uint32_t  id, world, dp, sp, ulysses, ring, heads, kv_heads;
    char      explain[256];
    uint32_t  ngroups[Q_KINDS], gsize[Q_KINDS];
    uint32_t *ids[Q_KINDS];          /* [ngroups] */
    uint32_t *ranks[Q_KINDS];        /* [world] */
    uint32_t *mem;                   /* the one allocation behind ids and ranks */
} q_mesh_t;

static int q_mesh_cmp(const void *a, const void *b)
{
    const q_mesh_t *x = a, *y = b;
    if (x->created_ns != y->created_ns)
        return x->created_ns < y->created_ns ? -1 : 1;
    return x->id < y->id ? -1 : x->id > y->id;
}

/* Copies a mesh's groups into r. Caller holds the lock. Returns false when out of memory. */
static bool q_mesh_copy(q_mesh_t *r, const sp_job_t *job, const sp_mesh_t *m)
{
    sp_group_t *const *kinds[Q_KINDS] = { m->dp_groups, m->sp_groups, m->ulysses_groups, m->ring_groups };
    uint32_t world = m->dp * m->sp;

    snprintf(r->job, sizeof r->job, "%s", job->id);
    r->created_ns = job->created_ns;
    r->id = m->id;
    r->world = world;
    r->dp = m->dp;
    r->sp = m->sp;
    r->ulysses = m->ulysses;
    r->ring = m->ring;
    r->heads = m->heads;
    r->kv_heads = m->kv_heads;
    snprintf(r->explain, sizeof r->explain, "%s", m->explain);
    r->ngroups[Q_DP] = m->sp;
    r->gsize[Q_DP] = m->dp;
    r->ngroups[Q_SP] = m->dp;
    r->gsize[Q_SP] = m->sp;
    r->ngroups[Q_ULYSSES] = m->dp * m->ring;
    r->gsize[Q_ULYSSES] = m->ulysses;
    r->ngroups[Q_RING] = m->dp * m->ulysses;
    r->gsize[Q_RING] = m->ring;

    size_t words = 0;
    for (int k = 0; k < Q_KINDS; k++)
        words += (size_t)r->ngroups[k] + world;
    if ((r->mem = malloc(words * sizeof *r->mem)) == NULL)
        return false;
    uint32_t *p = r->mem;
    for (int k = 0; k < Q_KINDS; k++) {
        r->ids[k] = p;
        p += r->ngroups[k];
        r->ranks[k] = p;
        p += world;
        for (uint32_t i = 0; i < r->ngroups[k]; i++) {
            const sp_group_t *g = kinds[k][i];
            r->ids[k][i] = g->id;
            /* Every group of a kind has gsize members; copy no more whatever it says. */
            for (uint32_t j = 0; j < r->gsize[k]; j++)
                r->ranks[k][(size_t)i * r->gsize[k] + j] = j < g->size ? g->ranks[j] : UINT32_MAX;
        }
    }
    return true;
}

/* "7:[0 1] 8:[2 3]": each group of a kind as id:[job ranks]. */
static void q_mesh_groups_text(const q_mesh_t *r, int k, qtext_t *t)
{
    char num[16];
    for (uint32_t i = 0; i < r->ngroups[k] && !t->cut; i++) {
        snprintf(num, sizeof num, "%s%u:[", i ? " " : "", r->ids[k][i]);
        qt_add(t, num);
        for (uint32_t j = 0; j < r->gsize[k]; j++) {
            snprintf(num, sizeof num, "%s%u", j ? " " : "", r->ranks[k][(size_t)i * r->gsize[k] + j]);
            qt_add(t, num);
        }
        qt_add(t, "]");
    }
}

static spc_status_t query_mesh(sp_server_t *srv, qb_t *q, const char *arg, const sp_viewer_t *v, sp_err_t *e)
{
    sp_engine_t *eng = srv->eng;
    sp_job_t *only;
    q_mesh_t *rows = NULL;
    size_t n = 0, cap = 0;

    pthread_mutex_lock(&eng->lock);
    spc_status_t st = query_job_filter(eng, arg, v, &only, e);
    for (sp_job_t *job = st == SPC_OK ? eng->jobs : NULL; job != NULL && !q->oom; job = job->next) {
        if (!job_shown(job, only, v))
            continue;
        for (const sp_mesh_t *m = job->meshes; m != NULL && !q->oom; m = m->next) {
            if (!rows_reserve((void **)&rows, &cap, n, sizeof *rows)) {
                q->oom = true;
                break;
            }
            if (!q_mesh_copy(&rows[n], job, m))
                q->oom = true;
            n++;
        }
    }
    pthread_mutex_unlock(&eng->lock);

    if (n > 1)
        qsort(rows, n, sizeof *rows, q_mesh_cmp);
    for (size_t i = 0; i < n && !q->oom; i++) {
        const q_mesh_t *r = &rows[i];
        qtext_t t = { 0 };
        qb_record(q);
        qb_str(q, "job", r->job);
        qb_int(q, "mesh", r->id);
        qb_int(q, "world_size", r->world);
        qb_int(q, "dp", r->dp);
        qb_int(q, "sp", r->sp);
        qb_int(q, "ulysses", r->ulysses);
        qb_int(q, "ring", r->ring);
        qb_int(q, "heads", r->heads);
        qb_int(q, "kv_heads", r->kv_heads);
        qb_str(q, "explain", r->explain);
        for (int k = 0; k < Q_KINDS; k++) {
            q_mesh_groups_text(r, k, &t);
            qb_text(q, q_kind_key[k], &t);
        }
    }
    for (size_t i = 0; i < n; i++)
        free(rows[i].mem);
    free(rows);
    return st;
}

/* ---- in-flight ops */

/* One collective that some ranks have arrived at and that has not failed. */
typedef struct q_op {
    char      job[SP_JOB_ID_MAX];
    uint64_t  created_ns;             /* of the job, for the order */
    char      kind[12];
    bool      world;
    uint32_t  group, size, channel, arrived;
    uint32_t  opmask;                 /* 1 << opcode of every arrived op */
    uint64_t  seq, first_ns, deadline_ns;
    uint32_t *ranks;                  /* [size]: job rank of each group rank */
    uint8_t  *here;                   /* [size]: whether that rank arrived */
} q_op_t;

static int q_op_cmp(const void *a, const void *b)
{
    const q_op_t *x = a, *y = b;
    if (x->created_ns != y->created_ns)
        return x->created_ns < y->created_ns ? -1 : 1;
    if (x->group != y->group)
        return x->group < y->group ? -1 : 1;
    if (x->channel != y->channel)
        return x->channel < y->channel ? -1 : 1;
    return x->seq < y->seq ? -1 : x->seq > y->seq;
}

/* Copies a pending collective into r. Caller holds the lock. */
static bool q_op_copy(q_op_t *r, const sp_group_t *g, const sp_coll_t *coll)
{
    snprintf(r->job, sizeof r->job, "%s", g->job->id);
    r->created_ns = g->job->created_ns;
    snprintf(r->kind, sizeof r->kind, "%s", g->kind);
    r->world = g == g->job->world;
    r->group = g->id;
    r->size = g->size;
    r->channel = coll->channel;
    r->arrived = coll->arrived;
    r->seq = coll->seq;
    r->first_ns = coll->first_ns;
    r->deadline_ns = coll->deadline_ns;
    if ((r->ranks = malloc((size_t)g->size * (sizeof *r->ranks + 1))) == NULL)
        return false;
    r->here = (uint8_t *)(r->ranks + g->size);
    memcpy(r->ranks, g->ranks, (size_t)g->size * sizeof *r->ranks);
    for (uint32_t k = 0; k < g->size; k++) {
        const sp_op_t *op = coll->ops[k];
        r->here[k] = op != NULL;
        if (op != NULL)
            r->opmask |= op->sqe.opcode < 32 ? 1u << op->sqe.opcode : 1u << 31;
    }
    return true;
}

/* The ranks that did (here = 1) or did not arrive: "0 2" in the world,
 * "0(4) 2(6)" (group rank, job rank) in other groups; "-" when none. */
static void q_op_ranks_text(const q_op_t *r, uint8_t here, qtext_t *t)
{
    char num[32];
    bool any = false;
    for (uint32_t k = 0; k < r->size && !t->cut; k++) {
        if (r->here[k] != here)
            continue;
        if (r->world)
            snprintf(num, sizeof num, "%s%u", any ? " " : "", k);
        else
            snprintf(num, sizeof num, "%s%u(%u)", any ? " " : "", k, r->ranks[k]);
        qt_add(t, num);
        any = true;
    }
    if (!any)
        qt_add(t, "-");
}

static spc_status_t query_ops(sp_server_t *srv, qb_t *q, const char *arg, const sp_viewer_t *v, sp_err_t *e)
{
    sp_engine_t *eng = srv->eng;
    sp_job_t *only;
    q_op_t *rows = NULL;
    size_t n = 0, cap = 0;

    pthread_mutex_lock(&eng->lock);
    spc_status_t st = query_job_filter(eng, arg, v, &only, e);
    for (sp_job_t *job = st == SPC_OK ? eng->jobs : NULL; job != NULL && !q->oom; job = job->next) {
        if (!job_shown(job, only, v))
            continue;
        for (const sp_group_t *g = job->groups; g != NULL && !q->oom; g = g->next) {
            for (unsigned ch = 0; ch < SP_CHANNELS && !q->oom; ch++) {
                for (const sp_coll_t *coll = g->colls[ch]; coll != NULL; coll = coll->next) {
                    /* Failed ones only wait for late ranks to collect their error. */
                    if (coll->failed != SPC_OK || coll->arrived == 0)
                        continue;
                    if (!rows_reserve((void **)&rows, &cap, n, sizeof *rows)) {
                        q->oom = true;
                        break;
                    }
                    if (!q_op_copy(&rows[n++], g, coll)) {
                        q->oom = true;
                        break;
                    }
                }
            }
        }
    }
    pthread_mutex_unlock(&eng->lock);

    uint64_t now = sp_now_ns();
    if (n > 1)
        qsort(rows, n, sizeof *rows, q_op_cmp);
    for (size_t i = 0; i < n && !q->oom; i++) {
        const q_op_t *r = &rows[i];
        qtext_t t = { 0 };
        for (unsigned oc = 0; oc < 32; oc++) {
            if (r->opmask & (1u << oc)) {
                if (t.len > 0)
                    qt_add(&t, "/");   /* ranks disagree already: shown, refused when all arrive */
                qt_add(&t, sp_op_name(oc));
            }
        }
        qb_record(q);
        qb_str(q, "job", r->job);
        qb_int(q, "group", r->group);
        qb_str(q, "kind", r->kind);
        qb_int(q, "channel", r->channel);
        qb_int(q, "seq", (int64_t)r->seq);
        qb_text(q, "op", &t);
        qb_int(q, "arrived", r->arrived);
        qb_int(q, "size", r->size);
        q_op_ranks_text(r, 1, &t);
        qb_text(q, "arrived_ranks", &t);
        q_op_ranks_text(r, 0, &t);
        qb_text(q, "missing_ranks", &t);
        qb_double(q, "waiting_s", now > r->first_ns ? (double)(now - r->first_ns) / 1e9 : 0.0);
        qb_double(q, "timeout_in_s", ((double)r->deadline_ns - (double)now) / 1e9);
    }
    for (size_t i = 0; i < n; i++)
        free(rows[i].ranks);
    free(rows);
    return st;
}

/* ---- op statistics, the flight recorder, metrics (stats.c, metrics.c) */

/* Group rank r as text: "3" in the world, "1(5)" (group rank, job rank) elsewhere. */
static void q_rank_text(const sp_stats_copy_t *c, uint32_t r, char *buf, size_t len)
{
    if (r >= c->size)
        snprintf(buf, len, "-");
    else if (c->world)
        snprintf(buf, len, "%u", r);
    else
        snprintf(buf, len, "%u(%u)", r, c->ranks[r]);
}

/* The counters of one kind: ops, failures (by status, as "SPC_ERR_TIMEOUT:2 ..."),
 * bytes, and durations in microseconds from the histogram. */
static void q_opstats(qb_t *q, const sp_opstats_t *s)
{
    qtext_t t = { 0 };
    char item[96];
    qb_int(q, "ops", (int64_t)s->ops);
    qb_int(q, "failed", (int64_t)s->failed);
    for (unsigned j = 0; j <= SP_STATUS_COUNT; j++) {
        if (s->failed_by[j] == 0)
            continue;
        snprintf(item, sizeof item, "%s%s:%" PRIu64, t.len ? " " : "",
                 j < SP_STATUS_COUNT ? spc_status_name(sp_stats_status_of(j)) : "SPC_UNKNOWN_STATUS", s->failed_by[j]);
        qt_add(&t, item);
    }
    qb_text(q, "failures", &t);
    qb_int(q, "bytes", (int64_t)s->bytes);
    uint64_t ok = s->ops - s->failed;
    qb_double(q, "mean_us", ok ? (double)s->sum_ns / (double)ok / 1e3 : 0.0);
    qb_double(q, "p50_us", sp_stats_quantile_ns(s, 0.50) / 1e3);
    qb_double(q, "p90_us", sp_stats_quantile_ns(s, 0.90) / 1e3);
    qb_double(q, "p99_us", sp_stats_quantile_ns(s, 0.99) / 1e3);
    qb_double(q, "max_us", (double)s->max_ns / 1e3);
}

/* One record per op kind that ran: daemon-wide (every job, when arg is empty),
 * then per group of the live jobs. */
static spc_status_t query_stats(sp_server_t *srv, qb_t *q, const char *arg, const sp_viewer_t *v, sp_err_t *e)
{
    sp_engine_t *eng = srv->eng;
    sp_opstats_t total[SP_STATS_KINDS];
    sp_stats_copy_t *c = NULL;
    size_t n = 0;
    bool found;

    pthread_mutex_lock(&eng->lock);
    int rc = sp_stats_copy(eng, arg, v, false, total, &c, &n, &found);
    pthread_mutex_unlock(&eng->lock);
    if (rc != 0) {
        q->oom = true;
        return SPC_OK;
    }
    if (!found)
        return sp_err_set(e, SPC_ERR_NOT_FOUND, "no job '%.128s' on this daemon", arg);
    for (unsigned k = 0; (arg == NULL || arg[0] == '\0') && k < SP_STATS_KINDS; k++) {
        if (total[k].ops == 0)
            continue;
        qb_record(q);
        qb_str(q, "scope", "daemon");
        qb_str(q, "job", "");
        qb_int(q, "group", -1);
        qb_str(q, "kind", "");
        qb_int(q, "size", 0);
        qb_str(q, "op", sp_stats_kind_name(k));
        q_opstats(q, &total[k]);
    }
    for (size_t i = 0; i < n; i++) {
        for (unsigned k = 0; k < SP_STATS_KINDS; k++) {
            if (c[i].op[k].ops == 0)
                continue;
            qb_record(q);
            qb_str(q, "scope", "group");
            qb_str(q, "job", c[i].job);
            qb_int(q, "group", c[i].group_id);
            qb_str(q, "kind", c[i].kind);
            qb_int(q, "size", c[i].size);
            qb_str(q, "op", sp_stats_kind_name(k));
            q_opstats(q, &c[i].op[k]);
        }
    }
    sp_stats_copies_free(c, n);
    return SPC_OK;
}

static double q_us(uint64_t from, uint64_t to)
{
    return from == 0 || to == 0 || to < from ? -1.0 : (double)(to - from) / 1e3;
}

/* The flight recorders: every kept record of the job's groups (all jobs when
 * arg is empty, ended ones included), oldest first within a group. */
static spc_status_t query_history(sp_server_t *srv, qb_t *q, const char *arg, const sp_viewer_t *v, sp_err_t *e)
{
    sp_engine_t *eng = srv->eng;
    sp_opstats_t total[SP_STATS_KINDS];
    sp_stats_copy_t *c = NULL;
    size_t n = 0;
    bool found;
    char text[32];

    pthread_mutex_lock(&eng->lock);
    int rc = sp_stats_copy(eng, arg, v, true, total, &c, &n, &found);
    pthread_mutex_unlock(&eng->lock);
    if (rc != 0) {
        q->oom = true;
        return SPC_OK;
    }
    if (!found)
        return sp_err_set(e, SPC_ERR_NOT_FOUND, "no job '%.128s' on this daemon, nor a record of it", arg);
    uint64_t now = sp_now_ns();
    for (size_t i = 0; i < n && !q->oom; i++) {
        for (uint32_t j = 0; j < c[i].nrecs; j++) {
            const sp_oprec_t *r = &c[i].recs[j];
            qtext_t t = { 0 };
            qb_record(q);
            qb_str(q, "job", c[i].job);
            qb_int(q, "group", c[i].group_id);
            qb_str(q, "kind", c[i].kind);
            qb_int(q, "size", c[i].size);
            qb_int(q, "job_ended", c[i].ended);
            qb_int(q, "channel", r->channel);
            qb_int(q, "seq", (int64_t)r->seq);
            qb_str(q, "op", sp_stats_kind_name(r->opcode < SP_STATS_KINDS ? r->opcode : SP_STATS_KINDS - 1));
            qb_str(q, "status", spc_status_name(r->status));
            qb_str(q, "detail", r->detail);
            qb_int(q, "bytes", (int64_t)r->bytes);
            qb_int(q, "arrived", r->arrived);
            q_rank_text(&c[i], r->first_rank, text, sizeof text);
            qb_str(q, "first_rank", text);
            q_rank_text(&c[i], r->last_rank, text, sizeof text);
            qb_str(q, "last_rank", text);
            for (uint32_t m = 0; m < r->nmissing && m < SP_REC_MISSING; m++) {
                q_rank_text(&c[i], r->missing[m], text, sizeof text);
                qt_add(&t, m ? " " : "");
                qt_add(&t, text);
            }
            if (r->nmissing > SP_REC_MISSING)
                qt_add(&t, " ...");
            if (r->nmissing == 0)
                qt_add(&t, "-");
            qb_int(q, "missing", r->nmissing);
            qb_text(q, "missing_ranks", &t);
            /* Phases, in microseconds: ranks arriving, waiting for the progress
             * thread, moving the data; -1 for a phase the op never reached. */
            qb_double(q, "arrival_spread_us", q_us(r->first_ns, r->last_ns));
            qb_double(q, "queue_us", q_us(r->last_ns, r->start_ns));
            qb_double(q, "run_us", q_us(r->start_ns, r->end_ns));
            qb_double(q, "total_us", q_us(r->first_ns, r->end_ns));
            qb_double(q, "ended_ago_s", now > r->end_ns ? (double)(now - r->end_ns) / 1e9 : 0.0);
        }
    }
    sp_stats_copies_free(c, n);
    return SPC_OK;
}

/* One record, its field "text" the whole Prometheus exposition (metrics.c),
 * with the series of the jobs the viewer may see. */
static void query_metrics(sp_server_t *srv, qb_t *q, const sp_viewer_t *v)
{
    char *text;
    size_t len;
    sp_metrics_source_t src = sp_server_metrics_source(srv);
    if (sp_metrics_render(&src, v, &text, &len) != 0) {
        q->oom = true;
        return;
    }
    qb_record(q);
    qb_str(q, "text", text);
    free(text);
}

/* ---- this node's topology */

/* One record: the node, where its topology came from, and the topology in the
 * text format of sp_topo.h, which `spctl topo` prints as it is. The topology is
 * set before the loop runs and never changes, so no lock is needed. */
static void query_topo(sp_server_t *srv, qb_t *q)
{
    const sp_topo_t *topo = srv->eng->topo;
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    if (f == NULL) {
        q->oom = true;
        return;
    }
    if (topo != NULL)
        sp_topo_dump(topo, f);
    if (fclose(f) != 0) {
        free(text);
        q->oom = true;
        return;
    }
    qb_record(q);
    qb_str(q, "node", topo != NULL ? topo->nodes[0].name : srv->node);
    qb_str(q, "source", srv->cfg->topology_file[0] ? "file" : "discovered");
    qb_str(q, "file", srv->cfg->topology_file);
    qb_int(q, "numa_nodes", topo != NULL ? topo->nodes[0].nnuma : 0);
    qb_int(q, "nics", topo != NULL ? topo->nodes[0].nnics : 0);
    qb_int(q, "gpus", topo != NULL ? topo->nodes[0].ngpus : 0);
    qb_str(q, "topology", text);
    free(text);
}

void sp_query_answer(sp_session_t *s, const Spd__Msg *msg)
{
    sp_server_t *srv = s->srv;
    uint32_t seq = msg->seq;
    const Spd__QueryReq *req = msg->query_req;
    qb_t q = { .rep = SPD__QUERY_REP__INIT };
    sp_err_t e = SP_ERR_INIT;
    spc_status_t st = SPC_OK;
    /* Users that share spd through allow_group see their own jobs only. */
    const sp_viewer_t v = { .self = geteuid(), .uid = s->uid };

    if (strcmp(req->topic, "status") == 0) {
        query_status(srv, &q);
    } else if (strcmp(req->topic, "clients") == 0) {
        query_clients(srv, &q, &v);
    } else if (strcmp(req->topic, "config") == 0) {
        st = query_config(srv, &q, req->arg, &e);
    } else if (strcmp(req->topic, "jobs") == 0) {
        st = query_jobs(srv, &q, req->arg, &v, &e);
    } else if (strcmp(req->topic, "mesh") == 0) {
        st = query_mesh(srv, &q, req->arg, &v, &e);
    } else if (strcmp(req->topic, "ops") == 0) {
        st = query_ops(srv, &q, req->arg, &v, &e);
    } else if (strcmp(req->topic, "peers") == 0) {
        sp_peers_foreach(&srv->peers, query_peer, &q);
    } else if (strcmp(req->topic, "topo") == 0) {
        query_topo(srv, &q);
    } else if (strcmp(req->topic, "stats") == 0) {
        st = query_stats(srv, &q, req->arg, &v, &e);
    } else if (strcmp(req->topic, "history") == 0) {
        st = query_history(srv, &q, req->arg, &v, &e);
    } else if (strcmp(req->topic, "metrics") == 0) {
        query_metrics(srv, &q, &v);
    } else {
        st = sp_err_set(&e, SPC_ERR_NOT_FOUND, "unknown topic '%.64s' (status, clients, config, jobs, mesh, ops, "
                        "history, stats, metrics, peers, topo)", req->topic);
    }
    if (st == SPC_OK && q.oom)
        st = sp_err_set(&e, SPC_ERR_NO_MEMORY, "out of memory building the answer");
    if (st != SPC_OK) {
        sp_session_reply_err(s, seq, &e);
    } else {
        Spd__Msg m = SPD__MSG__INIT;
        m.seq = seq;
        m.body_case = SPD__MSG__BODY_QUERY_REP;
        m.query_rep = &q.rep;
        sp_session_send(s, &m);
    }
    qb_free(&q);
}
