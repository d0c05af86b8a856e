/*
 * main.c — spd: the per-node daemon of sequence-parallel communication.
 *
 *   spd [--config FILE] [--set name=value]... [--dump-config] [--version]
 *
 * Startup: read the configuration (defaults < file < SPD_* environment < --set),
 * open the log, read the topology file if there is one, create the engine and
 * its progress thread, bind the socket (finding the GPUs), discover the
 * topology if no file gave it, tell the service manager READY=1, run the loop.
 * SIGTERM drains and exits 0. A command line it cannot read exits 2, with the
 * usage.
 */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <uv.h>

#include "base/config.h"
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
            "  --dump-config        print the resolved configuration, documented, and exit\n"
            "  --version            print the version and exit\n"
            "  --help               this text\n"
            "Every option can also be set as SPD_<NAME> in the environment; see deploy/spd.conf.\n");
}

int main(int argc, char **argv)
{
    sp_config_t cfg;
    sp_topo_t *topo = NULL;
    sp_err_t e = SP_ERR_INIT;
    const char *config_file = getenv("SPD_CONFIG");
    int dump = 0;
    int rc = 1;

    sp_config_init(&cfg);

    /* First pass: the file, so that --set given before --config still wins. */
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--config") == 0 && i + 1 < argc)
            config_file = argv[++i];
        else if (strncmp(argv[i], "--config=", 9) == 0)
            config_file = argv[i] + 9;
    }
    if (config_file != NULL && *config_file != '\0' && sp_config_load_file(&cfg, config_file, &e) != SPC_OK) {
        fprintf(stderr, "spd: %s\n", e.msg);
        goto out;
    }
    if (sp_config_load_env(&cfg, &e) != SPC_OK) {
        fprintf(stderr, "spd: %s\n", e.msg);
        goto out;
    }
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--config") == 0) {
            if (++i == argc) {
                fprintf(stderr, "spd: --config needs a file\n");
                usage(stderr);
                rc = 2;
                goto out;
            }
        } else if (strncmp(a, "--config=", 9) == 0) {
            continue;
        } else if (strcmp(a, "--set") == 0 || strncmp(a, "--set=", 6) == 0) {
            const char *kv = a[5] == '=' ? a + 6 : (i + 1 < argc ? argv[++i] : NULL);
            const char *eq = kv ? strchr(kv, '=') : NULL;
            if (eq == NULL) {
                fprintf(stderr, "spd: --set needs NAME=VALUE\n");
                usage(stderr);
                rc = 2;
                goto out;
            }
            char name[64];
            snprintf(name, sizeof name, "%.*s", (int)(eq - kv), kv);
            if (sp_config_set(&cfg, name, eq + 1, SP_SRC_CMDLINE, &e) != SPC_OK) {
                fprintf(stderr, "spd: --set %s: %s\n", kv, e.msg);
                goto out;
            }
        } else if (strcmp(a, "--dump-config") == 0) {
            dump = 1;
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
            rc = 2;
            goto out;
        }
    }
    if (dump) {
        sp_config_dump(&cfg, stdout, 1);
        rc = 0;
        goto out;
    }

    atomic_store(&sp_log_level, (int)cfg.log_level);
    atomic_store(&sp_log_mask, (uint32_t)cfg.log_subsys);
    int lrc = sp_log_open(cfg.log_file);
    if (lrc != 0) {
        fprintf(stderr, "spd: cannot open log file %s: %s\n", cfg.log_file, strerror(-lrc));
        goto out;
    }
    /* A client that vanishes mid-write must not kill the daemon. */
    signal(SIGPIPE, SIG_IGN);

    char node[64];
    if (cfg.node_name[0] != '\0') {
        snprintf(node, sizeof node, "%s", cfg.node_name);
    } else if (gethostname(node, sizeof node) != 0) {
        snprintf(node, sizeof node, "localhost");
    }
    node[sizeof node - 1] = '\0';

    char socket_path[4096];
    if (cfg.socket[0] != '\0')
        snprintf(socket_path, sizeof socket_path, "%s", cfg.socket);
    else
        sp_default_socket_path(socket_path, sizeof socket_path);

    sp_info(CORE, "spd %s starting on node %s (pid %d, uid %u)%s%s", SPD_VERSION, node, (int)getpid(),
            (unsigned)geteuid(), cfg.file[0] ? ", config " : "", cfg.file);

    /* Read before anything starts: a bad file stops spd at once, naming its line. */
    if (cfg.topology_file[0] != '\0' && sp_topo_load_node(cfg.topology_file, node, &topo, &e) != SPC_OK) {
        sp_error(CFG, "topology_file: %s", e.msg);
        goto out_log;
    }

    sp_engine_t eng;
    if (sp_engine_init(&eng, &cfg, node) != 0)
        goto out_log;
    uv_loop_t loop;
    uv_loop_init(&loop);
    sp_server_t srv;
    if (sp_server_init(&srv, &loop, &eng, &cfg, node, socket_path, &e) != SPC_OK)   /* logged */
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
    sp_topo_free(topo);
    sp_log_close();
out:
    sp_config_cleanup(&cfg);
    return rc;
}
