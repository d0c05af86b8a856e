/*
 * main.c — spd: the per-node daemon of sequence-parallel communication.
 *
 *   spd [--config FILE] [--set name=value]... [--check-config | --dump-config] [--version]
 *
 * Startup: read the configuration (defaults < file < SPD_* environment < --set)
 * and check it, reading the topology file if there is one (a configuration that
 * cannot run exits 78, EX_CONFIG, before anything starts), open the log, create the engine and
 * its progress thread, bind the socket (finding the GPUs), discover the
 * topology if no file gave it, tell the service manager READY=1, run the loop.
 * SIGTERM drains and exits 0. A command line it cannot read exits 2, with the
 * usage.
 */
#include <errno.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sysexits.h>
#include <unistd.h>
#include <uv.h>

#include "base/config.h"
#include "core/auth.h"
#include "core/engine.h"
#include "base/log.h"
#include "ctl/server.h"
#include "sp_paths.h"
#include "cluster/topo.h"
#include "version.h"

static void usage(FILE *out)
{
    fprintf(out,
            "Usage: spd [options]\n"
            "  --config FILE        read options from FILE (also $SPD_CONFIG)\n"
            "  --set NAME=VALUE     set an option (repeatable; wins over file and environment)\n"
            "  --check-config       check the configuration as a start would, print the problems, and exit:\n"
            "                       0 when it is good, 78 when not\n"
            "  --dump-config        print the resolved configuration, documented, and exit (78 when it is bad)\n"
            "  --version            print the version and exit\n"
            "  --help               this text\n"
            "Every option can also be set as SPD_<NAME> in the environment; see deploy/spd.conf.\n"
            "Exit status: 0 stopped cleanly, 1 failed, 2 bad arguments, 78 bad configuration.\n");
}

/* A problem with the configuration: a plain line for a person who asked
 * (--check-config, --dump-config), or an error of the log when spd was
 * starting, so that the journal files it at its priority whatever log_level
 * and log_subsys say. */
static void config_problem(bool starting, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void config_problem(bool starting, const char *fmt, ...)
{
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (starting)
        sp_log_emit(SP_LOG_ERROR, SP_LOG_BIT_CFG, "configuration: %s; spd does not start", msg);
    else
        fprintf(stderr, "spd: configuration: %s\n", msg);
}

/* Whether the configuration's options agree; each problem reported, how many
 * there were returned. */
static int config_disagreements(const sp_config_t *cfg, bool starting)
{
    char problems[4096];
    int n = sp_config_check(cfg, problems, sizeof problems);
    for (char *sv, *line = strtok_r(problems, "\n", &sv); line != NULL; line = strtok_r(NULL, "\n", &sv))
        config_problem(starting, "%s", line);
    return n;
}

/* Whether the configuration can run here: its options agree, and what they
 * name on this node exists (allow_group; topology_file, read into *topo_p
 * when topo_p is given). Each problem is reported, naming its options; how
 * many there were is returned. */
static int config_problems(const sp_config_t *cfg, const char *node, sp_topo_t **topo_p, bool starting)
{
    sp_err_t e = SP_ERR_INIT;
    long gid;

    int n = config_disagreements(cfg, starting);
    if (sp_auth_resolve_group(cfg->allow_group, &gid) != 0) {
        config_problem(starting, "allow_group: no group '%s'", cfg->allow_group);
        n++;
    }
    if (cfg->topology_file[0] != '\0') {
        sp_topo_t *topo = NULL;
        if (sp_topo_load_node(cfg->topology_file, node, &topo, &e) != SPC_OK) {
            config_problem(starting, "topology_file: %s", e.msg);
            n++;
        } else if (topo_p != NULL) {
            *topo_p = topo;
        } else {
            sp_topo_free(topo);
        }
    }
    return n;
}

int main(int argc, char **argv)
{
    sp_config_t cfg;
    sp_topo_t *topo = NULL;
    sp_err_t e = SP_ERR_INIT;
    const char **sets = calloc((size_t)argc, sizeof *sets);
    sp_config_args_t args = { .file = getenv("SPD_CONFIG"), .sets = sets };
    int dump = 0, check = 0;
    int rc = 2;   /* a command line it cannot read, as spctl */

    sp_server_block_signals();   /* before any thread: the loop reads them (server.c) */
    sp_config_init(&cfg);
    if (sets == NULL) {
        fprintf(stderr, "spd: out of memory\n");
        rc = 1;
        goto out;
    }
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--config") == 0 || strcmp(a, "--set") == 0) {
            if (i + 1 == argc) {
                fprintf(stderr, "spd: %s needs %s\n", a, a[2] == 'c' ? "a file" : "NAME=VALUE");
                usage(stderr);
                goto out;
            }
            if (a[2] == 'c')
                args.file = argv[++i];
            else
                sets[args.nsets++] = argv[++i];
        } else if (strncmp(a, "--config=", 9) == 0) {
            args.file = a + 9;
        } else if (strncmp(a, "--set=", 6) == 0) {
            sets[args.nsets++] = a + 6;
        } else if (strcmp(a, "--dump-config") == 0) {
            dump = 1;
        } else if (strcmp(a, "--check-config") == 0) {
            check = 1;
        } else if (strcmp(a, "--version") == 0) {
            printf("spd %s\n", SPD_VERSION);
            rc = 0;
            goto out;
        } else if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            usage(stdout);
            rc = 0;
            goto out;
        } else {
            fprintf(stderr, "spd: unknown argument '%s'\n", a);
            usage(stderr);
            goto out;
        }
    }
    /* From here a configuration that cannot run exits EX_CONFIG, which the unit
     * does not restart (RestartPreventExitStatus): another try would fail alike. */
    rc = EX_CONFIG;
    bool starting = !dump && !check;
    if (starting)
        sp_log_open(NULL);   /* standard error, where the journal may be listening */
    sp_config_cleanup(&cfg);
    if (sp_config_resolve(&cfg, &args, &e) != SPC_OK) {
        config_problem(starting, "%s", e.msg);
        goto out;
    }

    char node[64];
    if (cfg.node_name[0] != '\0') {
        snprintf(node, sizeof node, "%s", cfg.node_name);
    } else if (gethostname(node, sizeof node) != 0) {
        snprintf(node, sizeof node, "localhost");
    }
    node[sizeof node - 1] = '\0';

    if (dump) {
        sp_config_dump(&cfg, stdout, 1);
        rc = config_disagreements(&cfg, false) == 0 ? 0 : EX_CONFIG;
        goto out;
    }
    if (check) {
        int n = config_problems(&cfg, node, NULL, false);
        if (n == 0)
            printf("spd: configuration is good%s%s\n", cfg.file[0] ? ": " : "", cfg.file);
        rc = n == 0 ? 0 : EX_CONFIG;
        goto out;
    }
    atomic_store(&sp_log_level, (int)cfg.log_level);
    atomic_store(&sp_log_mask, (uint32_t)cfg.log_subsys);
    atomic_store(&sp_log_format, (int)cfg.log_format);
    if (config_problems(&cfg, node, &topo, true) != 0)
        goto out;
    rc = 1;

    int lrc = sp_log_open(cfg.log_file);
    if (lrc != 0) {
        fprintf(stderr, "spd: cannot open log file %s: %s\n", cfg.log_file, strerror(-lrc));
        goto out;
    }
    /* A client that vanishes mid-write must not kill the daemon. */
    signal(SIGPIPE, SIG_IGN);

    char socket_path[4096];
    if (cfg.socket[0] != '\0')
        snprintf(socket_path, sizeof socket_path, "%s", cfg.socket);
    else
        sp_default_socket_path(socket_path, sizeof socket_path);

    sp_info(CORE, "spd %s starting on node %s (pid %d, uid %u)%s%s", SPD_VERSION, node, (int)getpid(),
            (unsigned)geteuid(), cfg.file[0] ? ", config " : "", cfg.file);

    sp_engine_t eng;
    if (sp_engine_init(&eng, &cfg, node) != 0)
        goto out_log;
    uv_loop_t loop;
    uv_loop_init(&loop);
    sp_server_t srv;
    if (sp_server_init(&srv, &loop, &eng, &cfg, &args, node, socket_path, &e) != SPC_OK)   /* logged */
        goto out_engine;
    /* Discovery comes after the server's device probe, which finds the GPUs. */
    if (topo == NULL && sp_topo_discover("/sys", node, &srv.devices, &topo, &e) != SPC_OK) {
        sp_error(CORE, "topology discovery: %s", e.msg);
        goto out_engine;
    }
    eng.topo = topo;
    const sp_topo_node_t *here = &topo->nodes[0];
    sp_info(CORE, "topology %s%s: node %s, %u NUMA nodes, %u NICs, %u GPUs", cfg.topology_file[0] ? "from " :
            "discovered", cfg.topology_file, here->name, here->nnuma, here->nnics, here->ngpus);
    if (sp_engine_start(&eng) != 0)
        goto out_engine;

    sp_server_run(&srv);

    sp_engine_stop(&eng);
    sp_info(CORE, "spd stopped");
    rc = 0;

out_engine:
    uv_loop_close(&loop);
    sp_engine_cleanup(&eng);   /* the progress thread is stopped (or never ran) */
out_log:
    sp_log_close();
out:
    sp_topo_free(topo);
    sp_config_cleanup(&cfg);
    free(sets);
    return rc;
}
