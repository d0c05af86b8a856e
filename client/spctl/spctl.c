/*
 * spctl — look inside a running spd, and plan meshes for clusters.
 *
 *   spctl [--socket PATH] [--json] status
 *   spctl [--socket PATH] [--json] clients
 *   spctl [--socket PATH] [--json] config get NAME
 *   spctl [--socket PATH] [--json] config dump
 *   spctl [--socket PATH] [--json] jobs [JOB_ID]
 *   spctl [--socket PATH] [--json] mesh [JOB_ID]
 *   spctl [--socket PATH] [--json] ops [--history] [JOB_ID]
 *   spctl [--socket PATH] [--json] stats [JOB_ID]
 *   spctl [--socket PATH] [--json] top [--interval S] [--count N] [JOB_ID]   (top.c)
 *   spctl [--socket PATH] metrics
 *   spctl [--socket PATH] [--json] peers
 *   spctl [--socket PATH] [--json] topo
 *   spctl [--json] plan ARGS       (no daemon: see plan.c)
 *   spctl --version | --help
 *
 * Flags may come before the command or after it; an unknown flag, an operand
 * a command does not take, or a flag of another command is refused with the
 * usage and exit code 2, so that a typo never runs something else.
 *
 * The commands that ask a daemon speak only the public client API (a
 * control-only attach and spc_query), so everything they show is available to
 * any program. `topo` and `plan` also use the shared topology and placement
 * code of common/ (sp_topo.h, sp_place.h): to print a topology as JSON, and to
 * place a mesh without a daemon.
 */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sp_topo.h"
#include "spclient/spclient.h"
#include "spctl.h"
#include "version.h"

static void usage(FILE *out)
{
    fprintf(out,
            "Usage: spctl [--socket PATH] [--json] COMMAND [ARGS]\n"
            "   or: spctl --version | --help\n"
            "commands:\n"
            "  status            version, protocols served, uptime, clients, jobs, transports, GPUs\n"
            "  clients           attached clients: pid, uid, protocol, job, rank, ops in flight\n"
            "  config get NAME   one option: value, default, where it came from\n"
            "  config dump       every option\n"
            "  jobs [JOB_ID]     jobs: world size, ranks joined, groups, meshes, ops pending, age\n"
            "  mesh [JOB_ID]     meshes: degrees (dp x sp = ring x ulysses), why, and every group\n"
            "                    of each kind as id:[job ranks]\n"
            "  ops [JOB_ID]      collectives in flight: group, channel, sequence number, op, the\n"
            "                    ranks arrived and missing (group ranks; job ranks in parentheses\n"
            "                    when the group is not the world), how long it has waited\n"
            "  ops --history [JOB_ID]\n"
            "                    the flight recorder: each group's last collectives that ended\n"
            "                    (op_history of them), with their status, the ranks that came\n"
            "                    first, last and never, and their phases; then those in flight.\n"
            "                    Groups of jobs that ended are kept a while\n"
            "  stats [JOB_ID]    per op kind, daemon-wide and per group: ops, failures by status,\n"
            "                    bytes, durations (mean, p50, p90, p99, max: from the first rank's\n"
            "                    arrival to completion, successful ops)\n"
            "  metrics           the same counters and more in the Prometheus text format, as\n"
            "                    served on metrics_listen\n"
            "  peers             the other daemons: node, address, direction, state (and why it\n"
            "                    is down or refused), last heard, heartbeat round trip, next dial\n"
            "  topo              this node's NUMA nodes, NICs, GPUs and GPU pairs, in the topology\n"
            "                    file format (spd reads such a file with topology_file)\n"
            "  top [JOB_ID]      a live view, refreshed every --interval seconds (1 by default)\n"
            "                    until interrupted or --count refreshes: ops per second and\n"
            "                    bandwidth of the daemon and of each group, and the ops waiting\n"
            "                    for ranks, with the ranks missing; --json prints a line per refresh\n"
            "  plan ARGS         place a mesh on a cluster and count its bytes per link, without a\n"
            "                    daemon (spctl plan --help)\n"
            "JOB_ID limits jobs, mesh, ops, stats and top to one job. --json prints the records as JSON\n"
            "(query topics: status, clients, config, jobs, mesh, ops, history, stats, metrics,\n"
            "peers, topo).\n"
            "Flags go before or after the command. The socket is --socket, else $SPC_SOCKET, else\n"
            "the default (%s).\n"
            "Exit status: 0 done, 1 the daemon could not be reached or refused, 2 bad usage.\n",
            spc_socket_path(NULL));
}

/* ---------------------------------------------------------------- output */

void spctl_json_string(const char *s)
{
    putchar('"');
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\')
            printf("\\%c", c);
        else if (c == '\n')
            fputs("\\n", stdout);
        else if (c < 0x20)
            printf("\\u%04x", c);
        else
            putchar(c);
    }
    putchar('"');
}

static void json_value(const spc_query_result_t *r, size_t rec, size_t f)
{
    switch (spc_query_kind(r, rec, f)) {
    case SPC_VALUE_INT:
        printf("%lld", (long long)spc_query_int(r, rec, f));
        break;
    case SPC_VALUE_DOUBLE:
        printf("%.6g", spc_query_double(r, rec, f));
        break;
    default:
        spctl_json_string(spc_query_str(r, rec, f));
        break;
    }
}

static void json_record(const spc_query_result_t *r, size_t rec)
{
    putchar('{');
    for (size_t f = 0; f < spc_query_fields(r, rec); f++) {
        if (f)
            putchar(',');
        spctl_json_string(spc_query_key(r, rec, f));
        putchar(':');
        json_value(r, rec, f);
    }
    putchar('}');
}

void spctl_json_list(const spc_query_result_t *r, int as_array)
{
    if (as_array)
        putchar('[');
    for (size_t i = 0; r != NULL && i < spc_query_records(r); i++) {
        if (i)
            putchar(',');
        json_record(r, i);
    }
    if (as_array)
        putchar(']');
}

static void json_records(const spc_query_result_t *r, int as_array)
{
    spctl_json_list(r, as_array);
    putchar('\n');
}

static void text_value(const spc_query_result_t *r, size_t rec, size_t f, char *buf, size_t len)
{
    switch (spc_query_kind(r, rec, f)) {
    case SPC_VALUE_INT:
        snprintf(buf, len, "%lld", (long long)spc_query_int(r, rec, f));
        break;
    case SPC_VALUE_DOUBLE:
        snprintf(buf, len, "%.1f", spc_query_double(r, rec, f));
        break;
    default:
        snprintf(buf, len, "%s", spc_query_str(r, rec, f));
        break;
    }
}

static const char *get_str(const spc_query_result_t *r, size_t rec, const char *key, char *buf, size_t len)
{
    long f = spc_query_find(r, rec, key);
    if (f < 0)
        snprintf(buf, len, "-");
    else
        text_value(r, rec, (size_t)f, buf, len);
    return buf;
}

/* ---------------------------------------------------------------- commands */

static void print_status(const spc_query_result_t *r)
{
    char v[256];
    for (size_t f = 0; f < spc_query_fields(r, 0); f++) {
        text_value(r, 0, f, v, sizeof v);
        printf("%-17s %s\n", spc_query_key(r, 0, f), v);
    }
}

static void print_clients(const spc_query_result_t *r)
{
    char id[32], pid[32], uid[32], name[80], proto[16], job[160], rank[16], inflight[16], ops[32], failed[32],
        regions[16];
    printf("%-4s %-8s %-6s %-16s %-5s %-6s %-9s %-10s %-8s %-8s %s\n", "ID", "PID", "UID", "NAME", "PROTO", "RANK",
           "INFLIGHT", "OPS", "FAILED", "REGIONS", "JOB");
    for (size_t i = 0; i < spc_query_records(r); i++) {
        get_str(r, i, "rank", rank, sizeof rank);
        printf("%-4s %-8s %-6s %-16s %-5s %-6s %-9s %-10s %-8s %-8s %s\n", get_str(r, i, "id", id, sizeof id),
               get_str(r, i, "pid", pid, sizeof pid), get_str(r, i, "uid", uid, sizeof uid),
               get_str(r, i, "name", name, sizeof name), get_str(r, i, "protocol", proto, sizeof proto),
               strcmp(rank, "-1") == 0 ? "-" : rank,
               get_str(r, i, "inflight", inflight, sizeof inflight), get_str(r, i, "ops_submitted", ops, sizeof ops),
               get_str(r, i, "ops_failed", failed, sizeof failed), get_str(r, i, "regions", regions, sizeof regions),
               get_str(r, i, "job", job, sizeof job)[0] ? job : "-");
    }
    if (spc_query_records(r) == 0)
        printf("(no clients attached)\n");
}

static void print_config(const spc_query_result_t *r, int one)
{
    char name[64], value[4200], source[16], dflt[256];
    for (size_t i = 0; i < spc_query_records(r); i++) {
        get_str(r, i, "name", name, sizeof name);
        get_str(r, i, "value", value, sizeof value);
        get_str(r, i, "source", source, sizeof source);
        get_str(r, i, "default", dflt, sizeof dflt);
        if (one)
            printf("%s %s\n  source: %s\n  default: %s\n", name, value[0] ? value : "\"\"", source,
                   dflt[0] ? dflt : "\"\"");
        else
            printf("%-18s %-28s # %s\n", name, value[0] ? value : "\"\"", source);
    }
}

static void print_jobs(const spc_query_result_t *r)
{
    char id[160], world[16], joined[16], complete[8], wg[16], groups[16], meshes[16], pending[16], age[32];
    char nodes[256], owner[16];
    printf("%-6s %-6s %-9s %-6s %-7s %-7s %-8s %-8s %-20s %-7s %s\n", "WORLD", "JOINED", "COMPLETE", "WGROUP",
           "GROUPS", "MESHES", "PENDING", "AGE_S", "NODES", "OWNER", "JOB");
    for (size_t i = 0; i < spc_query_records(r); i++) {
        get_str(r, i, "complete", complete, sizeof complete);
        get_str(r, i, "world_group", wg, sizeof wg);
        get_str(r, i, "owner_uid", owner, sizeof owner);
        printf("%-6s %-6s %-9s %-6s %-7s %-7s %-8s %-8s %-20s %-7s %s\n",
               get_str(r, i, "world_size", world, sizeof world), get_str(r, i, "joined", joined, sizeof joined),
               strcmp(complete, "1") == 0 ? "yes" : "no", strcmp(wg, "-1") == 0 ? "-" : wg,
               get_str(r, i, "groups", groups, sizeof groups), get_str(r, i, "meshes", meshes, sizeof meshes),
               get_str(r, i, "ops_pending", pending, sizeof pending), get_str(r, i, "age_s", age, sizeof age),
               get_str(r, i, "nodes", nodes, sizeof nodes), strcmp(owner, "-1") == 0 ? "-" : owner,
               get_str(r, i, "id", id, sizeof id));
        if (spc_query_find(r, i, "waiting_for") >= 0 && get_str(r, i, "waiting_for", nodes, sizeof nodes)[0] != '\0')
            printf("  waiting for node %s to come back: %s ms left (peer_restart_grace_ms)\n", nodes,
                   get_str(r, i, "waiting_left_ms", pending, sizeof pending));
    }
    if (spc_query_records(r) == 0)
        printf("(no jobs)\n");
}

/* Prints a long list of "id:[ranks]" items wrapped under a label. */
static void print_wrapped(const char *label, const char *list)
{
    const int width = 100, indent = 19;
    int col = printf("  %-16s ", label);
    const char *p = list;
    while (*p) {
        const char *end = strchr(p, ']');
        size_t n = end ? (size_t)(end - p + 1) : strlen(p);
        while (*p == ' ' && n > 0) {
            p++;
            n--;
        }
        if (col > indent && col + 1 + (int)n > width) {
            printf("\n%*s", indent, "");
            col = indent;
        } else if (col > indent) {
            putchar(' ');
            col++;
        }
        col += printf("%.*s", (int)n, p);
        p += n;
    }
    putchar('\n');
}

static void print_mesh(const spc_query_result_t *r)
{
    static const char *const kinds[][2] = { { "dp_groups", "dp groups" }, { "sp_groups", "sp groups" },
                                            { "ulysses_groups", "ulysses groups" }, { "ring_groups", "ring groups" } };
    char job[160], id[16], dp[16], sp[16], u[16], ring[16], heads[16], kv[16], explain[300];
    for (size_t i = 0; i < spc_query_records(r); i++) {
        printf("%sjob %s mesh %s: dp %s x sp %s (ulysses %s x ring %s), heads %s, kv_heads %s\n", i ? "\n" : "",
               get_str(r, i, "job", job, sizeof job), get_str(r, i, "mesh", id, sizeof id),
               get_str(r, i, "dp", dp, sizeof dp), get_str(r, i, "sp", sp, sizeof sp),
               get_str(r, i, "ulysses", u, sizeof u), get_str(r, i, "ring", ring, sizeof ring),
               get_str(r, i, "heads", heads, sizeof heads), get_str(r, i, "kv_heads", kv, sizeof kv));
        printf("  %-16s %s\n", "why", get_str(r, i, "explain", explain, sizeof explain));
        for (size_t k = 0; k < sizeof kinds / sizeof kinds[0]; k++) {
            long f = spc_query_find(r, i, kinds[k][0]);
            print_wrapped(kinds[k][1], f < 0 ? "-" : spc_query_str(r, i, (size_t)f));
        }
    }
    if (spc_query_records(r) == 0)
        printf("(no meshes)\n");
}

static void print_ops(const spc_query_result_t *r)
{
    char job[160], group[16], kind[16], ch[16], seq[32], op[64], arrived[16], size[16], wait[32], left[32];
    for (size_t i = 0; i < spc_query_records(r); i++) {
        printf("%sjob %s group %s (%s, %s ranks) channel %s: %s #%s, %s of %s arrived, waiting %s s, times out "
               "in %s s\n", i ? "\n" : "", get_str(r, i, "job", job, sizeof job),
               get_str(r, i, "group", group, sizeof group), get_str(r, i, "kind", kind, sizeof kind),
               get_str(r, i, "size", size, sizeof size), get_str(r, i, "channel", ch, sizeof ch),
               get_str(r, i, "op", op, sizeof op), get_str(r, i, "seq", seq, sizeof seq),
               get_str(r, i, "arrived", arrived, sizeof arrived), size, get_str(r, i, "waiting_s", wait, sizeof wait),
               get_str(r, i, "timeout_in_s", left, sizeof left));
        long f = spc_query_find(r, i, "arrived_ranks");
        printf("  arrived: %s\n", f < 0 ? "-" : spc_query_str(r, i, (size_t)f));
        f = spc_query_find(r, i, "missing_ranks");
        printf("  missing: %s\n", f < 0 ? "-" : spc_query_str(r, i, (size_t)f));
    }
    if (spc_query_records(r) == 0)
        printf("(no ops in flight)\n");
}

/* A phase in microseconds, "-" for one the op never reached (-1). */
static const char *phase(const spc_query_result_t *r, size_t rec, const char *key, char *buf, size_t len)
{
    long f = spc_query_find(r, rec, key);
    if (f < 0 || spc_query_kind(r, rec, (size_t)f) != SPC_VALUE_DOUBLE || spc_query_double(r, rec, (size_t)f) < 0)
        snprintf(buf, len, "-");
    else
        snprintf(buf, len, "%.1f", spc_query_double(r, rec, (size_t)f));
    return buf;
}

/* The flight recorder, a block per group: a line per collective, its failure's
 * detail under it. */
static void print_history(const spc_query_result_t *r)
{
    char job[160], group[16], kind[16], size[16], ended[8], prev[200] = "";
    char ch[8], seq[24], op[16], status[40], detail[300], bytes[24], arrived[16], first[24], last[24];
    char missing[16], mranks[200], spread[32], queue[32], run[32], total[32], ago[32];
    for (size_t i = 0; i < spc_query_records(r); i++) {
        char key[200];
        get_str(r, i, "job", job, sizeof job);
        get_str(r, i, "group", group, sizeof group);
        snprintf(key, sizeof key, "%s/%s", job, group);
        if (strcmp(key, prev) != 0) {
            get_str(r, i, "job_ended", ended, sizeof ended);
            printf("%sjob %s%s group %s (%s, %s ranks):\n", prev[0] ? "\n" : "", job,
                   strcmp(ended, "1") == 0 ? " (ended)" : "", group, get_str(r, i, "kind", kind, sizeof kind),
                   get_str(r, i, "size", size, sizeof size));
            printf("  %-3s %-7s %-10s %-22s %-10s %-8s %-8s %-8s %-10s %-9s %-9s %-10s %s\n", "CH", "SEQ", "OP",
                   "STATUS", "BYTES", "ARRIVED", "FIRST", "LAST", "SPREAD_US", "QUEUE_US", "RUN_US", "TOTAL_US",
                   "AGO_S");
            snprintf(prev, sizeof prev, "%s", key);
        }
        get_str(r, i, "status", status, sizeof status);
        get_str(r, i, "missing", missing, sizeof missing);
        get_str(r, i, "arrived", arrived, sizeof arrived);
        char arr[40];
        snprintf(arr, sizeof arr, "%s/%s", arrived, size);
        printf("  %-3s %-7s %-10s %-22s %-10s %-8s %-8s %-8s %-10s %-9s %-9s %-10s %s\n",
               get_str(r, i, "channel", ch, sizeof ch), get_str(r, i, "seq", seq, sizeof seq),
               get_str(r, i, "op", op, sizeof op), strcmp(status, "SPC_OK") == 0 ? "ok" : status,
               get_str(r, i, "bytes", bytes, sizeof bytes), arr, get_str(r, i, "first_rank", first, sizeof first),
               get_str(r, i, "last_rank", last, sizeof last), phase(r, i, "arrival_spread_us", spread, sizeof spread),
               phase(r, i, "queue_us", queue, sizeof queue), phase(r, i, "run_us", run, sizeof run),
               phase(r, i, "total_us", total, sizeof total), get_str(r, i, "ended_ago_s", ago, sizeof ago));
        if (strcmp(missing, "0") != 0)
            printf("      missing: %s\n", get_str(r, i, "missing_ranks", mranks, sizeof mranks));
        get_str(r, i, "detail", detail, sizeof detail);
        if (detail[0] != '\0')
            printf("      %s\n", detail);
    }
    if (spc_query_records(r) == 0)
        printf("(no ops recorded)\n");
}

static void print_stats(const spc_query_result_t *r)
{
    char job[160], group[16], kind[16], size[16], op[16], ops[24], failed[24], bytes[24];
    char mean[32], p50[32], p90[32], p99[32], max[32], failures[512];
    printf("%-10s %-6s %-8s %-5s %-9s %-7s %-13s %-9s %-9s %-9s %-9s %-9s %s\n", "OP", "GROUP", "KIND", "SIZE",
           "OPS", "FAILED", "BYTES", "MEAN_US", "P50_US", "P90_US", "P99_US", "MAX_US", "JOB");
    for (size_t i = 0; i < spc_query_records(r); i++) {
        char scope[16];
        bool daemon = strcmp(get_str(r, i, "scope", scope, sizeof scope), "daemon") == 0;
        get_str(r, i, "group", group, sizeof group);
        get_str(r, i, "kind", kind, sizeof kind);
        get_str(r, i, "size", size, sizeof size);
        printf("%-10s %-6s %-8s %-5s %-9s %-7s %-13s %-9s %-9s %-9s %-9s %-9s %s\n", get_str(r, i, "op", op, sizeof op),
               daemon ? "-" : group, daemon ? "(all)" : kind, daemon ? "-" : size,
               get_str(r, i, "ops", ops, sizeof ops), get_str(r, i, "failed", failed, sizeof failed),
               get_str(r, i, "bytes", bytes, sizeof bytes), get_str(r, i, "mean_us", mean, sizeof mean),
               get_str(r, i, "p50_us", p50, sizeof p50), get_str(r, i, "p90_us", p90, sizeof p90),
               get_str(r, i, "p99_us", p99, sizeof p99), get_str(r, i, "max_us", max, sizeof max),
               daemon ? "(daemon)" : get_str(r, i, "job", job, sizeof job));
        if (get_str(r, i, "failures", failures, sizeof failures)[0] != '\0')
            printf("%-10s failed: %s\n", "", failures);
    }
    if (spc_query_records(r) == 0)
        printf("(no ops yet)\n");
}

static void print_peers(const spc_query_result_t *r)
{
    char node[64], addr[96], dir[8], state[24], since[32], heard[32], rtt[32], redial[32], why[200];
    printf("%-16s %-24s %-4s %-15s %-9s %-9s %-9s %-9s %s\n", "NODE", "ADDRESS", "DIR", "STATE", "SINCE_S",
           "HEARD_MS", "RTT_US", "REDIAL_S", "WHY");
    for (size_t i = 0; i < spc_query_records(r); i++) {
        get_str(r, i, "node", node, sizeof node);
        get_str(r, i, "heard_ms", heard, sizeof heard);
        get_str(r, i, "rtt_us", rtt, sizeof rtt);
        get_str(r, i, "redial_s", redial, sizeof redial);
        printf("%-16s %-24s %-4s %-15s %-9s %-9s %-9s %-9s %s\n", node[0] ? node : "?",
               get_str(r, i, "addr", addr, sizeof addr), get_str(r, i, "direction", dir, sizeof dir),
               get_str(r, i, "state", state, sizeof state), get_str(r, i, "since_s", since, sizeof since),
               heard[0] == '-' ? "-" : heard, rtt[0] == '-' ? "-" : rtt, redial[0] == '-' ? "-" : redial,
               get_str(r, i, "why", why, sizeof why));
    }
    if (spc_query_records(r) == 0)
        printf("(no peers: set peer_listen or peers)\n");
}

/* `spctl topo`: the text as spd wrote it, loadable by topology_file; or, with
 * --json, the same parsed into one object. */
static int print_topo(const spc_query_result_t *r, int json)
{
    char node[80], source[16], file[4200];
    long f = spc_query_find(r, 0, "topology");
    const char *text = f < 0 ? "" : spc_query_str(r, 0, (size_t)f);
    get_str(r, 0, "node", node, sizeof node);
    get_str(r, 0, "source", source, sizeof source);
    get_str(r, 0, "file", file, sizeof file);
    if (!json) {
        printf("# node %s: %s%s%s\n%s", node, source, file[0] ? " " : "", file, text);
        return 0;
    }
    sp_topo_t *topo;
    char err[512];
    if (sp_topo_parse(text, "spd's topology", &topo, err, sizeof err) != SPC_OK || topo->nnodes != 1) {
        fprintf(stderr, "spctl: %s\n", err);
        return 1;
    }
    const sp_topo_node_t *n = &topo->nodes[0];
    printf("{\"node\":");
    spctl_json_string(n->name);
    printf(",\"source\":");
    spctl_json_string(source);
    printf(",\"file\":");
    spctl_json_string(file);
    printf(",\"numa\":[");
    for (uint32_t i = 0; i < n->nnuma; i++) {
        printf("%s{\"id\":%d,\"cpus\":", i ? "," : "", (int)n->numa[i].id);
        spctl_json_string(n->numa[i].cpus);
        putchar('}');
    }
    printf("],\"nics\":[");
    for (uint32_t i = 0; i < n->nnics; i++) {
        printf("%s{\"name\":", i ? "," : "");
        spctl_json_string(n->nics[i].name);
        printf(",\"numa\":%d,\"speed_mbps\":%lld}", (int)n->nics[i].numa, (long long)n->nics[i].speed_mbps);
    }
    printf("],\"gpus\":[");
    for (uint32_t i = 0; i < n->ngpus; i++) {
        printf("%s{\"index\":%d,\"bus\":", i ? "," : "", (int)n->gpus[i].index);
        spctl_json_string(n->gpus[i].bus);
        printf(",\"numa\":%d,\"island\":%d}", (int)n->gpus[i].numa, (int)n->gpus[i].island);
    }
    printf("],\"p2p\":[");
    for (uint32_t i = 0; i < n->np2p; i++) {
        const sp_topo_p2p_t *p = &n->p2p[i];
        printf("%s{\"from\":%d,\"to\":%d,\"link\":\"%s\",\"access\":%d,\"perf_rank\":%d,\"atomics\":%d}",
               i ? "," : "", (int)p->from, (int)p->to, sp_topo_link_name(p->link), (int)p->access, (int)p->perf_rank,
               (int)p->atomics);
    }
    printf("]}\n");
    sp_topo_free(topo);
    return 0;
}

spc_status_t spctl_attach(const char *socket_path, spc_handle_t **h)
{
    spc_attach_params_t p = { .struct_size = sizeof p, .socket_path = socket_path, .name = "spctl",
                              .flags = SPC_ATTACH_CONTROL_ONLY, .timeout_ms = 10000 };
    spc_status_t st = spc_attach(&p, h);
    if (st != SPC_OK)
        fprintf(stderr, "spctl: %s: %s\n", spc_status_name(st), spc_last_error(NULL));
    return st;
}

/* ---------------------------------------------------------------- the command line */

/* The commands that ask a daemon, and how many operands each takes (a JOB_ID;
 * config's words are checked apart). */
typedef struct command {
    const char *name;
    int         max_operands;
} command_t;

static const command_t commands[] = {
    { "status", 0 }, { "clients", 0 }, { "config", 2 }, { "jobs", 1 }, { "mesh", 1 }, { "ops", 1 },
    { "stats", 1 },  { "metrics", 0 }, { "peers", 0 },  { "topo", 0 }, { "top", 1 },
};

/* The command line read whole before anything is asked, so that a flag means
 * the same before the command and after it. */
typedef struct args {
    spctl_top_opts_t top;
    const char *socket_path;
    const char *words[4];   /* the command, then its operands */
    int         nwords;
    bool        json, history, help, version, top_opts;
} args_t;

static int usage_error(const char *fmt, const char *what)
{
    fputs("spctl: ", stderr);
    fprintf(stderr, fmt, what);
    fputc('\n', stderr);
    usage(stderr);
    return 2;
}

/* The value of a flag given as `--flag VALUE` or `--flag=VALUE`; NULL (and *i
 * unchanged) when argv[*i] is not that flag. *missing is set when it is, but
 * the value is not there. */
static const char *flag_value(int argc, char **argv, int *i, const char *flag, bool *missing)
{
    size_t n = strlen(flag);
    if (strncmp(argv[*i], flag, n) != 0)
        return NULL;
    if (argv[*i][n] == '=')
        return argv[*i] + n + 1;
    if (argv[*i][n] != '\0')
        return NULL;
    if (*i + 1 >= argc) {
        *missing = true;
        return NULL;
    }
    return argv[++*i];
}

/* Reads argv into a; returns -1 when it is well formed, else the exit code
 * (2, the usage printed). `plan` takes the rest of the line as its own:
 * *plan_at is its index then, else 0. */
static int parse_args(int argc, char **argv, args_t *a, int *plan_at)
{
    *plan_at = 0;
    for (int i = 1; i < argc; i++) {
        const char *arg = argv[i], *v;
        bool missing = false;
        char *end;
        if (strcmp(arg, "--json") == 0) {
            a->json = true;
        } else if (strcmp(arg, "--history") == 0) {
            a->history = true;
        } else if (strcmp(arg, "--help") == 0 || strcmp(arg, "-h") == 0) {
            a->help = true;
        } else if (strcmp(arg, "--version") == 0) {
            a->version = true;
        } else if ((v = flag_value(argc, argv, &i, "--socket", &missing)) != NULL) {
            a->socket_path = v;
        } else if ((v = flag_value(argc, argv, &i, "--count", &missing)) != NULL) {
            long n = strtol(v, &end, 10);
            if (*v == '\0' || *end != '\0' || n < 1)
                return usage_error("--count needs a whole number of refreshes, at least 1, not '%s'", v);
            a->top.count = n;
            a->top_opts = true;
        } else if ((v = flag_value(argc, argv, &i, "--interval", &missing)) != NULL) {
            double s = strtod(v, &end);
            if (*v == '\0' || *end != '\0' || !(s >= 0.01 && s <= 3600))
                return usage_error("--interval needs seconds between 0.01 and 3600, not '%s'", v);
            a->top.interval_s = s;
            a->top_opts = true;
        } else if (missing) {
            return usage_error("%s needs a value", arg);
        } else if (arg[0] == '-') {
            return usage_error("unknown option '%s'", arg);
        } else if (a->nwords == 0 && strcmp(arg, "plan") == 0) {
            *plan_at = i;
            return -1;
        } else if (a->nwords == (int)(sizeof a->words / sizeof a->words[0])) {
            return usage_error("unexpected argument '%s'", arg);
        } else {
            a->words[a->nwords++] = arg;
        }
    }
    if (a->help || a->version)
        return -1;
    if (a->nwords == 0)
        return usage_error("%s", "no command");
    const command_t *c = NULL;
    for (size_t k = 0; k < sizeof commands / sizeof commands[0]; k++)
        if (strcmp(commands[k].name, a->words[0]) == 0)
            c = &commands[k];
    if (c == NULL)
        return usage_error("unknown command '%s'", a->words[0]);
    int operands = a->nwords - 1;
    if (strcmp(c->name, "config") == 0) {
        if (!(operands == 1 && strcmp(a->words[1], "dump") == 0) &&
            !(operands == 2 && strcmp(a->words[1], "get") == 0))
            return usage_error("%s", "config takes 'get NAME' or 'dump'");
    } else if (operands > c->max_operands) {
        return usage_error("unexpected argument '%s'", a->words[1 + c->max_operands]);
    }
    if (a->history && strcmp(c->name, "ops") != 0)
        return usage_error("%s", "--history is an option of ops");
    if (a->top_opts && strcmp(c->name, "top") != 0)
        return usage_error("%s", "--count and --interval are options of top");
    return -1;
}

int main(int argc, char **argv)
{
    args_t a = { .top = { .count = 0, .interval_s = 1.0 } };
    int plan_at, rc = parse_args(argc, argv, &a, &plan_at);
    if (rc >= 0)
        return rc;
    if (plan_at > 0)
        return spctl_plan(argc - plan_at, argv + plan_at, a.json);
    if (a.help) {
        usage(stdout);
        return 0;
    }
    if (a.version) {
        printf("spctl %s\n", SPD_VERSION);
        return 0;
    }
    const char *cmd = a.words[0], *arg = a.nwords > 1 ? a.words[1] : "";
    if (strcmp(cmd, "top") == 0)
        return spctl_top(a.socket_path, arg, a.json, &a.top);

    const char *topic = cmd;
    bool one = false;
    if (strcmp(cmd, "ops") == 0 && a.history) {
        topic = "history";   /* and then "ops", for those in flight */
    } else if (strcmp(cmd, "config") == 0) {
        one = strcmp(a.words[1], "get") == 0;
        arg = one ? a.words[2] : "";
    }

    spc_handle_t *h;
    if (spctl_attach(a.socket_path, &h) != SPC_OK)
        return 1;
    spc_query_result_t *r;
    spc_status_t st = spc_query(h, topic, arg, &r);
    if (st != SPC_OK) {
        fprintf(stderr, "spctl: %s: %s\n", spc_status_name(st), spc_last_error(h));
        spc_detach(h);
        return 1;
    }
    rc = 0;
    if (strcmp(topic, "history") == 0) {
        /* The flight recorder, then what is in flight now (nothing for a job that ended). */
        spc_query_result_t *pending = NULL;
        st = spc_query(h, "ops", arg, &pending);
        if (st != SPC_OK && st != SPC_ERR_NOT_FOUND) {
            fprintf(stderr, "spctl: %s: %s\n", spc_status_name(st), spc_last_error(h));
            rc = 1;
        } else if (a.json) {
            printf("{\"history\":");
            spctl_json_list(r, 1);
            printf(",\"in_flight\":");
            spctl_json_list(pending, 1);
            printf("}\n");
        } else {
            print_history(r);
            printf("\nin flight:\n");
            if (pending != NULL)
                print_ops(pending);
            else
                printf("(no ops in flight)\n");
        }
        spc_query_free(pending);
    } else if (strcmp(topic, "topo") == 0)
        rc = print_topo(r, a.json);
    else if (strcmp(topic, "metrics") == 0 && !a.json) {
        long f = spc_query_find(r, 0, "text");
        fputs(f < 0 ? "" : spc_query_str(r, 0, (size_t)f), stdout);
    } else if (a.json)
        json_records(r, strcmp(topic, "status") != 0 && !one);
    else if (strcmp(topic, "status") == 0)
        print_status(r);
    else if (strcmp(topic, "clients") == 0)
        print_clients(r);
    else if (strcmp(topic, "jobs") == 0)
        print_jobs(r);
    else if (strcmp(topic, "mesh") == 0)
        print_mesh(r);
    else if (strcmp(topic, "ops") == 0)
        print_ops(r);
    else if (strcmp(topic, "stats") == 0)
        print_stats(r);
    else if (strcmp(topic, "peers") == 0)
        print_peers(r);
    else
        print_config(r, one);
    spc_query_free(r);
    spc_detach(h);
    return rc;
}
