/* config.c — the option table and everything generated from it. See config.h. */
#include "base/config.h"

#include <ctype.h>
#include <stdarg.h>
#include <errno.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "sp_msg.h"
#include "base/netaddr.h"

#define OPT(name, type, def, min, max, doc) \
    { #name, type, offsetof(sp_config_t, name), def, min, max, doc, 0 }
/* An option a reload changes in the running daemon: one that only the loop
 * thread reads, or that the other threads read under the engine's lock, or an
 * atomic (the log's). */
#define LIVE(name, type, def, min, max, doc) \
    { #name, type, offsetof(sp_config_t, name), def, min, max, doc, 1 }

static const sp_option_t options[] = {
    OPT(socket, SP_OPT_STRING, "", 0, 0,
        "Unix socket clients attach to. Empty: /run/spd/spd.sock for root, else "
        "$XDG_RUNTIME_DIR/spd/spd.sock. Its directory is created mode 0700 (0710 with allow_group)."),
    OPT(node_name, SP_OPT_STRING, "", 0, 0,
        "Name of this node in job ids and logs. Empty: the host name."),
    OPT(allow_group, SP_OPT_STRING, "", 0, 0,
        "Group (name or gid) whose members may attach besides the daemon's own user. Empty: nobody else."),
    LIVE(max_clients, SP_OPT_INT, "256", 1, 65536,
        "Most sessions (trainer clients and spctl) at a time; more are refused."),
    OPT(protocol_max, SP_OPT_INT, "0", 0, SP_PROTOCOL_VERSION,
        "Highest client protocol spd serves; clients and spd take the highest both speak. 0: the newest this spd "
        "knows. A lower one serves every client as an spd of that protocol would (its segment layout included): "
        "to check clients against it, or to hold a fleet there while older libraries remain."),
    LIVE(session_idle_ms, SP_OPT_INT, "10000", 10, 3600000,
        "A session that has not said hello, or a control session (spctl) that has sent nothing, for this long "
        "is closed, so idle sessions cannot hold max_clients. Attached trainers are never closed for idleness."),
    OPT(max_frame_bytes, SP_OPT_SIZE, "1M", 4096, 64LL << 20,
        "Largest control frame accepted; a client that sends more is disconnected."),
    LIVE(reply_pause_bytes, SP_OPT_SIZE, "1M", 4096, 1LL << 30,
        "Replies a session has left unread beyond which spd stops reading its requests, until it has read "
        "them all."),
    LIVE(max_reply_bytes, SP_OPT_SIZE, "64M", 4096, 1LL << 32,
        "Replies a session may leave unread; past this it is disconnected, with the reason logged."),
    OPT(sq_entries, SP_OPT_INT, "256", 8, 4096,
        "Submission ring entries per client when the client does not ask (rounded up to a power "
        "of two); the completion ring gets twice as many."),
    OPT(arena_bytes, SP_OPT_SIZE, "256M", 1LL << 20, 1LL << 40,
        "Shared arena per client when the client does not ask. Pages are used only when touched."),
    OPT(max_arena_bytes, SP_OPT_SIZE, "64G", 1LL << 20, 1LL << 44,
        "Largest arena a client may ask for."),
    LIVE(max_registrations, SP_OPT_INT, "1024", 0, 1 << 20,
        "Most registered host memory regions per client."),
    LIVE(max_jobs_per_client, SP_OPT_INT, "64", 1, 1 << 20,
        "Most jobs one client may have created that are still live; more are refused until one ends."),
    OPT(max_named_jobs_per_user, SP_OPT_INT, "64", 1, 1 << 20,
        "Most named jobs (joined by a name, spc_job_join_named) one user may hold at a time, assembling or running; a join that would make one more is refused until one ends. A client is in one job at a time, so max_clients bounds them all."),
    OPT(gpu_host_staging_bytes, SP_OPT_SIZE, "1G", 64LL << 10, 1LL << 40,
        "Most pinned host memory spd keeps for ops between GPUs of this node that cannot reach each other (no "
        "peer access), whose inputs it stages through host memory; blocks are kept for later ops. An op that "
        "would need more is refused (SPC_ERR_LIMIT), naming this option."),
    OPT(gpu_device_staging_bytes, SP_OPT_SIZE, "4G", 1LL << 20, 1LL << 40,
        "Most GPU memory spd keeps on each GPU to stage ops on GPU memory across daemons (what NCCL brings "
        "from other daemons, and each communicator's headers); blocks are kept for later ops. An op that "
        "would need more is refused (SPC_ERR_LIMIT), naming this option, and spd goes on serving."),
    OPT(gpu_lanes_max, SP_OPT_INT, "31", 1, 31,
        "Most streams spd keeps on each GPU: one per client CUDA stream and one per NCCL communicator. Each "
        "needs a hardware queue of its own, of the CUDA_DEVICE_MAX_CONNECTIONS (spd asks for 32) less one for "
        "spd's own stream, so the lower of the two bounds it; a stream past it is refused (SPC_ERR_LIMIT), "
        "naming this option, and spd goes on serving."),
    OPT(staging_bytes, SP_OPT_SIZE, "256M", 1LL << 20, 1LL << 40,
        "Most memory spd takes to copy registered host memory (spc_register): for the operation it is "
        "running, and apart from that for its messages in flight to other daemons. On one daemon an "
        "all-reduce, all-gather, broadcast or shift larger than this streams through it in pieces; an "
        "all-to-all that needs more, or a tensor to send to another daemon that does not fit in what the "
        "messages in flight leave, is refused, naming this option. The operations' buffer is kept until "
        "none has used it for a second. Arena memory (spc_alloc) needs none."),
    LIVE(op_timeout_ms, SP_OPT_INT, "60000", 1, 86400000,
        "How long an operation waits for the other ranks of its group when the request names no "
        "timeout; then it fails on the ranks that arrived, naming the missing ones."),
    LIVE(op_history, SP_OPT_INT, "64", 0, 65536,
        "Ops each group keeps in its flight recorder (spctl ops --history): the last ones that ended, with "
        "their timings and the ranks that came late or never. 0: none kept (spctl stats still counts). A new "
        "value applies to groups created after it."),
    OPT(progress_spin_us, SP_OPT_INT, "50", 0, 1000000,
        "How long the progress thread keeps polling the rings after its last work before it sleeps."),
    OPT(progress_sleep_ms, SP_OPT_INT, "100", 1, 10000,
        "Longest sleep of the idle progress thread; it also wakes for deadlines and submitters."),
    OPT(progress_cpu, SP_OPT_INT, "-1", -1, 65535,
        "CPU to pin the progress thread to. -1: it floats, and steps aside from a CPU on which a "
        "client sleeps waiting for it."),
    OPT(copy_threads, SP_OPT_INT, "0", 0, 256,
        "Threads that share the copies of one large operation, the progress thread included. "
        "0: one per CPU the daemon may run on, at most 8."),
    LIVE(drain_timeout_ms, SP_OPT_INT, "10000", 0, 3600000,
        "On SIGTERM, how long in-flight operations may take to finish before they are failed."),
    OPT(peer_listen, SP_OPT_STRING, "", 0, 0,
        "Address other daemons connect to, host:port ([v6]:port; port 0 picks one, shown by spctl status). "
        "Empty: this daemon accepts no peer."),
    OPT(peers, SP_OPT_STRING, "", 0, 0,
        "Daemons to connect to, a comma list of host:port; each is redialled whenever its link drops."),
    OPT(peers_dns, SP_OPT_STRING, "", 0, 0,
        "Names whose every address (A and AAAA) is a daemon to connect to, a comma list of name:port: a "
        "Kubernetes headless Service, or a DNS name per rack. Resolved at start and every peers_dns_interval_ms; "
        "an address that goes away has its link closed, one that comes is dialled. This daemon's own address "
        "among them is found at its first hello and left alone."),
    OPT(peers_dns_interval_ms, SP_OPT_INT, "30000", 100, 86400000,
        "How often the names of peers_dns are resolved again. A name that does not resolve keeps its peers."),
    OPT(peers_dns_max, SP_OPT_INT, "1024", 1, 65536,
        "Most peers taken from the names of peers_dns, all names together; addresses past it are left out, "
        "with a warning."),
    OPT(cluster_secret_file, SP_OPT_STRING, "", 0, 0,
        "File holding the secret every daemon of the cluster shares (mode 0600 or stricter); needed by "
        "peer_listen, peers and peers_dns. A daemon that cannot prove it knows the secret is refused."),
    OPT(cluster_secret_next_file, SP_OPT_STRING, "", 0, 0,
        "File of a second secret, accepted from other daemons besides cluster_secret_file's, so that the secret "
        "rotates without a restart: give every daemon the new secret here, then make it each one's "
        "cluster_secret_file (the old one here), then empty this file. Both files are read again when they "
        "change; links already up keep going. Absent or empty: no second secret."),
    OPT(peer_heartbeat_ms, SP_OPT_INT, "1000", 10, 600000,
        "How often a daemon tells each peer it is alive (and looks for peers to dial again)."),
    OPT(peer_redial_max_ms, SP_OPT_INT, "30000", 10, 3600000,
        "Longest wait before a peer whose link is down is dialled again. The first wait is peer_heartbeat_ms, "
        "doubling with each failure to this; each is drawn from the upper half of its span, so that daemons do "
        "not dial a returning peer in step."),
    OPT(peer_timeout_ms, SP_OPT_INT, "5000", 20, 3600000,
        "A peer not heard from for this long is marked down and its link closed. Time this daemon itself did not "
        "run (its timers ran that late: the machine or the scheduler held it) is not counted."),
    OPT(peer_restart_grace_ms, SP_OPT_INT, "0", 0, 3600000,
        "How long a job spanning daemons waits for one whose link dropped to restart and take its ranks back "
        "before they are lost (SPC_ERR_PEER_LOST, \"node X lost\"); also how long a restarted daemon waits "
        "for the others to take such a job back from it, not counting time this daemon itself did not run (as "
        "peer_timeout_ms). While it waits its groups stay whole and nothing is "
        "sent there for it; its ops with NCCL fail at once, and an op's own timeout still holds. Above 0 each "
        "daemon keeps a copy of the last two messages it sent per group, channel and peer; 0: they are lost at "
        "once."),
    OPT(peer_restart_keep_bytes, SP_OPT_SIZE, "1G", 0, 1LL << 40,
        "Most memory the copies kept for a peer's restart (peer_restart_grace_ms) may hold in all. A message "
        "past it is not kept: a restart that needs it fails that collective (SPC_ERR_RESTARTED) instead."),
    OPT(peer_max_pending, SP_OPT_INT, "64", 1, 65536,
        "Most links from other hosts that may be authenticating at once; one more is closed at accept. "
        "Each costs a descriptor and a few KiB for at most 5 s."),
    OPT(peer_max_pending_per_addr, SP_OPT_INT, "8", 1, 65536,
        "Most links from one address that may be authenticating at once, so that one host cannot take "
        "every slot of peer_max_pending."),
    OPT(peer_inbox_msgs, SP_OPT_INT, "4096", 16, 1 << 24,
        "Most data-path messages from one daemon held undelivered (out of order, or before their job "
        "exists here); a daemon that sends more has its link dropped."),
    OPT(peer_inbox_bytes, SP_OPT_SIZE, "4G", 1LL << 20, 1LL << 44,
        "Most bytes of data-path messages from one daemon held undelivered (one message may be larger "
        "when nothing else waits); a daemon that sends more has its link dropped."),
    OPT(max_name_lookups, SP_OPT_INT, "256", 1, 1 << 20,
        "Most named joins that may wait at once to learn which daemon of the cluster is their job's home (the "
        "daemon where its rank 0 joined); each asks every linked daemon once per name_lookup_ms. One more is "
        "refused (SPC_ERR_LIMIT) until one ends. Queries from other daemons are answered at once and never wait."),
    LIVE(name_lookup_ms, SP_OPT_INT, "200", 10, 60000,
        "How long a named join that waits for its job's home gives the linked daemons to answer, and how often "
        "it asks them again while rank 0 has not joined, until the join's own deadline. A daemon that has not "
        "answered by then is taken as not holding the name."),
    OPT(fd_reserve, SP_OPT_INT, "64", 0, 1 << 20,
        "Descriptors kept for clients and spctl: a link from another host that would leave fewer free "
        "(under RLIMIT_NOFILE) is closed at accept."),
    OPT(metrics_listen, SP_OPT_STRING, "", 0, 0,
        "Address of the Prometheus endpoint (GET /metrics, text format 0.0.4), a numeric host:port "
        "([v6]:port; port 0 picks one, shown by spctl status), e.g. 127.0.0.1:9464. Empty: no endpoint "
        "(spctl metrics prints the same text). Only loopback addresses unless metrics_allow_remote."),
    OPT(metrics_allow_remote, SP_OPT_INT, "0", 0, 1,
        "1: metrics_listen may be an address other machines reach. The endpoint has no authentication "
        "and, with metrics_per_group or metrics_per_peer, names jobs, groups and peers; put it behind a firewall "
        "or a proxy that has."),
    OPT(metrics_per_group, SP_OPT_INT, "0", 0, 1,
        "1: the metrics also count each live job's groups apart (spd_group_*, labels job_id, group, group_kind "
        "and op: 17 series per group and op kind it ran). 0: only the totals by op kind, whatever the jobs."),
    OPT(metrics_per_peer, SP_OPT_INT, "0", 0, 1,
        "1: the metrics also show each peer daemon (spd_peer_up and spd_peer_last_rtt_seconds, label node), "
        "which grows with the cluster. 0: only the counts of peers up and down, and one round-trip histogram."),
    LIVE(log_file, SP_OPT_STRING, "", 0, 0,
        "Log file (appended; opened again on SIGHUP, after logrotate moved it). Empty: standard error."),
    LIVE(log_level, SP_OPT_LEVEL, "info", 0, 0,
        "error, warn, info, debug or trace."),
    LIVE(log_subsys, SP_OPT_SUBSYS, "all", 0, 0,
        "Subsystems to log: all, or a comma list of core, cfg, ctl, ring, job, op, mem, xport, peer."),
    LIVE(log_format, SP_OPT_FORMAT, "text", 0, 0,
        "text: one line per event, time host:pid:tid level subsystem message. json: the same fields as one JSON "
        "object per line (time, host, pid, tid, level, subsys, msg)."),
    OPT(topology_file, SP_OPT_STRING, "", 0, 0,
        "File (the format `spctl topo` prints) to read this node's NUMA nodes, NICs and GPUs from instead of "
        "discovering them in /sys: its only node, or the one named like this node. Empty: discover."),
    OPT(nccl_library, SP_OPT_STRING, "", 0, 0,
        "NCCL library that moves GPU-memory operations between daemons, loaded when the first one comes. "
        "Empty: the one the build found, then libnccl.so.2 on the loader's path. Without it such operations "
        "are refused with the reason; everything else works."),
};

#define N_OPTIONS (sizeof options / sizeof options[0])
_Static_assert(N_OPTIONS <= sizeof(((sp_config_t *)0)->source), "source[] too small");

const sp_option_t *sp_config_options(size_t *count_p)
{
    *count_p = N_OPTIONS;
    return options;
}

const sp_option_t *sp_config_find(const char *name, size_t *index_p)
{
    for (size_t i = 0; i < N_OPTIONS; i++) {
        if (strcmp(options[i].name, name) == 0) {
            if (index_p)
                *index_p = i;
            return &options[i];
        }
    }
    return NULL;
}


/* Parses a size with an optional K/M/G/T suffix. */
static int parse_size(const char *s, int64_t *v_p)
{
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (end == s || errno != 0 || *s == '-')
        return -1;
    int shift = 0;
    switch (toupper((unsigned char)*end)) {
    case 'K': shift = 10; end++; break;
    case 'M': shift = 20; end++; break;
    case 'G': shift = 30; end++; break;
    case 'T': shift = 40; end++; break;
    default: break;
    }
    if (*end == 'B' || *end == 'b')
        end++;
    if (*end != '\0' || v > (unsigned long long)(INT64_MAX >> shift))
        return -1;
    *v_p = (int64_t)(v << shift);
    return 0;
}

static int parse_int(const char *s, int64_t *v_p)
{
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (end == s || *end != '\0' || errno != 0)
        return -1;
    *v_p = v;
    return 0;
}

static spc_status_t set_value(sp_config_t *cfg, const sp_option_t *o, const char *value, sp_err_t *e)
{
    void *field = (char *)cfg + o->offset;
    int64_t v;
    uint32_t mask;
    const char *bad;

    switch (o->type) {
    case SP_OPT_STRING: {
        char *copy = strdup(value);
        if (copy == NULL)
            return sp_err_set(e, SPC_ERR_NO_MEMORY, "out of memory");
        free(*(char **)field);
        *(char **)field = copy;
        return SPC_OK;
    }
    case SP_OPT_INT:
    case SP_OPT_SIZE:
        if ((o->type == SP_OPT_INT ? parse_int(value, &v) : parse_size(value, &v)) != 0)
            return sp_err_set(e, SPC_ERR_INVALID_ARG, "%s: '%s' is not %s", o->name, value, o->type == SP_OPT_INT ?
                              "an integer" : "a size (bytes, K, M, G or T)");
        if (v < o->min || v > o->max)
            return sp_err_set(e, SPC_ERR_INVALID_ARG, "%s: %s is outside [%" PRId64 ", %" PRId64 "]", o->name, value,
                              o->min, o->max);
        *(int64_t *)field = v;
        return SPC_OK;
    case SP_OPT_LEVEL:
        v = sp_log_level_parse(value);
        if (v < 0)
            return sp_err_set(e, SPC_ERR_INVALID_ARG, "%s: '%s' is not one of error, warn, info, debug, trace", o->name,
                              value);
        *(int64_t *)field = v;
        return SPC_OK;
    case SP_OPT_SUBSYS:
        if (sp_log_mask_parse(value, &mask, &bad) != 0)
            return sp_err_set(e, SPC_ERR_INVALID_ARG, "%s: unknown subsystem '%s'", o->name, bad);
        *(int64_t *)field = mask;
        return SPC_OK;
    case SP_OPT_FORMAT:
        v = sp_log_format_parse(value);
        if (v < 0)
            return sp_err_set(e, SPC_ERR_INVALID_ARG, "%s: '%s' is not text or json", o->name, value);
        *(int64_t *)field = v;
        return SPC_OK;
    }
    return sp_err_set(e, SPC_ERR_INVALID_ARG, "%s: bad option type", o->name);
}

void sp_config_init(sp_config_t *cfg)
{
    sp_err_t e = SP_ERR_INIT;

    memset(cfg, 0, sizeof *cfg);
    for (size_t i = 0; i < N_OPTIONS; i++) {
        /* Defaults are compiled in; a bad one is a bug the unit test catches. */
        if (set_value(cfg, &options[i], options[i].def, &e) != SPC_OK)
            abort();
        cfg->source[i] = SP_SRC_DEFAULT;
    }
}

void sp_config_cleanup(sp_config_t *cfg)
{
    if (cfg == NULL)
        return;
    for (size_t i = 0; i < N_OPTIONS; i++) {
        if (options[i].type == SP_OPT_STRING) {
            char **field = (char **)((char *)cfg + options[i].offset);
            free(*field);
            *field = NULL;
        }
    }
}

spc_status_t sp_config_set(sp_config_t *cfg, const char *name, const char *value, sp_opt_source_t src, sp_err_t *e)
{
    size_t i;
    const sp_option_t *o = sp_config_find(name, &i);

    if (o == NULL)
        return sp_err_set(e, SPC_ERR_NOT_FOUND, "unknown option '%s'", name);
    SP_CHECK(set_value(cfg, o, value, e));
    cfg->source[i] = (uint8_t)src;
    return SPC_OK;
}

static char *trim(char *s)
{
    while (isspace((unsigned char)*s))
        s++;
    char *e = s + strlen(s);
    while (e > s && isspace((unsigned char)e[-1]))
        *--e = '\0';
    return s;
}

spc_status_t sp_config_load_file(sp_config_t *cfg, const char *path, sp_err_t *e)
{
    FILE *f = fopen(path, "re");
    if (f == NULL)
        return sp_err_set(e, errno == ENOENT ? SPC_ERR_NOT_FOUND : SPC_ERR_PERMISSION, "%s: %s", path, strerror(errno));

    char line[4096];
    int lineno = 0;
    spc_status_t st = SPC_OK;
    while (fgets(line, sizeof line, f) != NULL) {
        lineno++;
        char *s = trim(line);
        if (*s == '\0' || *s == '#')
            continue;
        char *name = s;
        size_t n = strcspn(s, " \t");
        char *value = s + n;
        if (*value != '\0')
            *value++ = '\0';
        value = trim(value);
        /* A value may be quoted so that it can be empty or hold spaces. */
        size_t vl = strlen(value);
        if (vl >= 2 && value[0] == '"' && value[vl - 1] == '"') {
            value[vl - 1] = '\0';
            value++;
        } else if (vl == 0) {
            st = sp_err_set(e, SPC_ERR_INVALID_ARG, "%s:%d: option '%s' has no value (write \"\" for empty)", path,
                            lineno, name);
            break;
        }
        if ((st = sp_config_set(cfg, name, value, SP_SRC_FILE, e)) != SPC_OK) {
            sp_err_prefix(e, "%s:%d: ", path, lineno);
            break;
        }
    }
    fclose(f);
    if (st == SPC_OK)
        snprintf(cfg->file, sizeof cfg->file, "%s", path);
    return st;
}

spc_status_t sp_config_load_env(sp_config_t *cfg, sp_err_t *e)
{
    char var[96];

    for (size_t i = 0; i < N_OPTIONS; i++) {
        int n = snprintf(var, sizeof var, "SPD_%s", options[i].name);
        for (int k = 4; k < n; k++)
            var[k] = (char)toupper((unsigned char)var[k]);
        const char *v = getenv(var);
        if (v == NULL)
            continue;
        if (sp_config_set(cfg, options[i].name, v, SP_SRC_ENV, e) != SPC_OK)
            return sp_err_prefix(e, "%s: ", var);
    }
    return SPC_OK;
}

static void format_subsys(int64_t mask, char *buf, size_t len)
{
    static const char *const names[] = {
#define SP__NAME(name, str) str,
        SP_LOG_SUBSYS_MAP(SP__NAME)
#undef SP__NAME
    };
    if ((uint32_t)mask == SP_LOG_ALL) {
        snprintf(buf, len, "all");
        return;
    }
    size_t off = 0;
    buf[0] = '\0';
    for (int i = 0; i < SP_LOG_SUBSYS_COUNT; i++)
        if (mask & (1 << i))
            off += (size_t)snprintf(buf + off, off < len ? len - off : 0, "%s%s", off ? "," : "", names[i]);
}

static void format_size(int64_t v, char *buf, size_t len)
{
    static const char suffix[] = "KMGT";
    int s = -1;
    while (s < 3 && v != 0 && v % 1024 == 0) {
        v /= 1024;
        s++;
    }
    if (s < 0)
        snprintf(buf, len, "%" PRId64, v);
    else
        snprintf(buf, len, "%" PRId64 "%c", v, suffix[s]);
}

void sp_config_format(const sp_config_t *cfg, size_t i, char *buf, size_t len)
{
    const sp_option_t *o = &options[i];
    const void *field = (const char *)cfg + o->offset;

    switch (o->type) {
    case SP_OPT_STRING: snprintf(buf, len, "%s", *(char *const *)field); break;
    case SP_OPT_INT:    snprintf(buf, len, "%" PRId64, *(const int64_t *)field); break;
    case SP_OPT_SIZE:   format_size(*(const int64_t *)field, buf, len); break;
    case SP_OPT_LEVEL:  snprintf(buf, len, "%s", sp_log_level_name((int)*(const int64_t *)field)); break;
    case SP_OPT_SUBSYS: format_subsys(*(const int64_t *)field, buf, len); break;
    case SP_OPT_FORMAT: snprintf(buf, len, "%s", sp_log_format_name((int)*(const int64_t *)field)); break;
    }
}

const char *sp_config_source_name(sp_opt_source_t src)
{
    switch (src) {
    case SP_SRC_DEFAULT: return "default";
    case SP_SRC_FILE:    return "file";
    case SP_SRC_ENV:     return "env";
    case SP_SRC_CMDLINE: return "set";
    }
    return "?";
}

void sp_config_dump(const sp_config_t *cfg, FILE *out, int with_doc)
{
    char value[4200];
    for (size_t i = 0; i < N_OPTIONS; i++) {
        if (with_doc)
            fprintf(out, "%s# %s%s\n", i ? "\n" : "", options[i].doc,
                    options[i].live ? " (Changes on SIGHUP.)" : "");
        sp_config_format(cfg, i, value, sizeof value);
        if (value[0] == '\0' || strpbrk(value, " \t#") != NULL)
            fprintf(out, "%s \"%s\"\n", options[i].name, value);
        else
            fprintf(out, "%s %s\n", options[i].name, value);
    }
}

/* ---------------------------------------------------------------- resolving and checking */

spc_status_t sp_config_resolve(sp_config_t *cfg, const sp_config_args_t *args, sp_err_t *e)
{
    sp_config_init(cfg);
    if (args->file != NULL && args->file[0] != '\0')
        SP_CHECK(sp_config_load_file(cfg, args->file, e));
    SP_CHECK(sp_config_load_env(cfg, e));
    for (int i = 0; i < args->nsets; i++) {
        const char *kv = args->sets[i];
        const char *eq = strchr(kv, '=');
        char name[64];
        if (eq == NULL)
            return sp_err_set(e, SPC_ERR_INVALID_ARG, "--set %s: give NAME=VALUE", kv);
        snprintf(name, sizeof name, "%.*s", (int)(eq - kv), kv);
        if (sp_config_set(cfg, name, eq + 1, SP_SRC_CMDLINE, e) != SPC_OK)
            return sp_err_prefix(e, "--set %s: ", kv);
    }
    return SPC_OK;
}

/* One disagreement, as a line of out. */
static void problem(char *out, size_t len, int *count, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
static void problem(char *out, size_t len, int *count, const char *fmt, ...)
{
    size_t used = strlen(out);
    va_list ap;
    va_start(ap, fmt);
    if (used + 1 < len)
        vsnprintf(out + used, len - used - 1, fmt, ap);
    va_end(ap);
    used = strlen(out);
    if (used + 1 < len) {
        out[used] = '\n';
        out[used + 1] = '\0';
    }
    (*count)++;
}

int sp_config_check(const sp_config_t *cfg, char *out, size_t len)
{
    int n = 0;
    char size_a[32], size_b[32];

    out[0] = '\0';
    if ((cfg->peer_listen[0] != '\0' || cfg->peers[0] != '\0') && cfg->cluster_secret_file[0] == '\0')
        problem(out, len, &n, "peer_listen and peers need cluster_secret_file: daemons prove to each other that they "
                "hold the cluster's secret before they link");
    if (cfg->metrics_listen[0] != '\0') {
        struct sockaddr_storage sa;
        if (sp_addr_parse(cfg->metrics_listen, &sa) != 0)
            problem(out, len, &n, "metrics_listen '%s': give a numeric address and a port (127.0.0.1:9464, "
                    "[::1]:9464)", cfg->metrics_listen);
        else if (!sp_addr_is_loopback((struct sockaddr *)&sa) && !cfg->metrics_allow_remote)
            problem(out, len, &n, "metrics_listen '%s' is not a loopback address, and the endpoint has no "
                    "authentication; set metrics_allow_remote 1 to serve other machines anyway", cfg->metrics_listen);
    }
    if (cfg->reply_pause_bytes > cfg->max_reply_bytes) {
        format_size(cfg->reply_pause_bytes, size_a, sizeof size_a);
        format_size(cfg->max_reply_bytes, size_b, sizeof size_b);
        problem(out, len, &n, "reply_pause_bytes (%s) is above max_reply_bytes (%s): a session would be dropped "
                "before spd stopped reading it", size_a, size_b);
    }
    if (cfg->arena_bytes > cfg->max_arena_bytes) {
        format_size(cfg->arena_bytes, size_a, sizeof size_a);
        format_size(cfg->max_arena_bytes, size_b, sizeof size_b);
        problem(out, len, &n, "arena_bytes (%s) is above max_arena_bytes (%s): a client that asks for no size "
                "would be refused", size_a, size_b);
    }
    if (cfg->peer_max_pending_per_addr > cfg->peer_max_pending)
        problem(out, len, &n, "peer_max_pending_per_addr (%" PRId64 ") is above peer_max_pending (%" PRId64 "): "
                "one address could take every slot", cfg->peer_max_pending_per_addr, cfg->peer_max_pending);
    if (cfg->peer_timeout_ms <= cfg->peer_heartbeat_ms)
        problem(out, len, &n, "peer_timeout_ms (%" PRId64 ") is not above peer_heartbeat_ms (%" PRId64 "): peers "
                "would be marked down between two heartbeats", cfg->peer_timeout_ms, cfg->peer_heartbeat_ms);
    if (n > 0 && out[0] != '\0' && out[strlen(out) - 1] == '\n')
        out[strlen(out) - 1] = '\0';
    return n;
}

int sp_config_apply_live(sp_config_t *to, const sp_config_t *from, char *restart_only, size_t len)
{
    char a[4200], b[4200];
    int changed = 0;

    restart_only[0] = '\0';
    for (size_t i = 0; i < N_OPTIONS; i++) {
        sp_config_format(to, i, a, sizeof a);
        sp_config_format(from, i, b, sizeof b);
        if (strcmp(a, b) == 0) {
            if (options[i].live)
                to->source[i] = from->source[i];
            continue;
        }
        if (!options[i].live) {
            size_t used = strlen(restart_only);
            snprintf(restart_only + used, len - used, "%s%s", used ? ", " : "", options[i].name);
            continue;
        }
        if (set_value(to, &options[i], b, &(sp_err_t)SP_ERR_INIT) != SPC_OK)
            return -1;   /* b is a value from->field held: only memory can fail */
        to->source[i] = from->source[i];
        changed++;
    }
    return changed;
}
