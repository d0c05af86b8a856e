/* The option table (daemon/base/config.c) and deploy/spd.conf kept in step with it. */
#include "base/config.h"
#include "base/log.h"
#include "sp_test.h"

static void test_defaults_roundtrip(void)
{
    sp_config_t cfg;
    char buf[4200];
    sp_err_t e = SP_ERR_INIT;
    size_t n;
    const sp_option_t *opts = sp_config_options(&n);

    sp_config_init(&cfg);
    for (size_t i = 0; i < n; i++) {
        /* The default, formatted, is the text in the table, and parses back to itself. */
        sp_config_format(&cfg, i, buf, sizeof buf);
        CHECK_STREQ(buf, opts[i].def);
        CHECK_EQ(sp_config_set(&cfg, opts[i].name, buf, SP_SRC_FILE, &e), SPC_OK);
        CHECK(strlen(opts[i].doc) > 10);
        CHECK_EQ(cfg.source[i], SP_SRC_FILE);
    }
    CHECK_EQ(cfg.max_frame_bytes, 1 << 20);
    CHECK_EQ(cfg.arena_bytes, 256LL << 20);
    CHECK_EQ(cfg.max_arena_bytes, 64LL << 30);
    CHECK_EQ(cfg.log_level, SP_LOG_INFO);
    sp_config_cleanup(&cfg);
}

static void test_errors(void)
{
    sp_config_t cfg;
    sp_err_t e = SP_ERR_INIT;
    sp_config_init(&cfg);
    CHECK_EQ(sp_config_set(&cfg, "no_such_option", "1", SP_SRC_CMDLINE, &e), SPC_ERR_NOT_FOUND);
    CHECK_CONTAINS(e.msg, "unknown option 'no_such_option'");
    CHECK_EQ(sp_config_set(&cfg, "sq_entries", "3", SP_SRC_CMDLINE, &e), SPC_ERR_INVALID_ARG);
    CHECK_CONTAINS(e.msg, "outside [8, 4096]");
    CHECK_EQ(sp_config_set(&cfg, "sq_entries", "12x", SP_SRC_CMDLINE, &e), SPC_ERR_INVALID_ARG);
    CHECK_CONTAINS(e.msg, "not an integer");
    CHECK_EQ(sp_config_set(&cfg, "arena_bytes", "-5M", SP_SRC_CMDLINE, &e), SPC_ERR_INVALID_ARG);
    CHECK_EQ(sp_config_set(&cfg, "arena_bytes", "99999999999T", SP_SRC_CMDLINE, &e), SPC_ERR_INVALID_ARG);
    CHECK_EQ(sp_config_set(&cfg, "log_level", "loud", SP_SRC_CMDLINE, &e), SPC_ERR_INVALID_ARG);
    CHECK_CONTAINS(e.msg, "not one of error, warn");
    CHECK_EQ(sp_config_set(&cfg, "log_subsys", "ctl,bogus", SP_SRC_CMDLINE, &e), SPC_ERR_INVALID_ARG);
    CHECK_CONTAINS(e.msg, "unknown subsystem 'bogus'");
    /* Sizes with suffixes. */
    CHECK_EQ(sp_config_set(&cfg, "arena_bytes", "3G", SP_SRC_CMDLINE, &e), SPC_OK);
    CHECK_EQ(cfg.arena_bytes, 3LL << 30);
    CHECK_EQ(sp_config_set(&cfg, "max_frame_bytes", "65536", SP_SRC_CMDLINE, &e), SPC_OK);
    char buf[64];
    size_t idx;
    sp_config_find("max_frame_bytes", &idx);
    sp_config_format(&cfg, idx, buf, sizeof buf);
    CHECK_STREQ(buf, "64K");
    CHECK_EQ(sp_config_set(&cfg, "log_subsys", "ctl,ring", SP_SRC_CMDLINE, &e), SPC_OK);
    sp_config_find("log_subsys", &idx);
    sp_config_format(&cfg, idx, buf, sizeof buf);
    CHECK_STREQ(buf, "ctl,ring");
    sp_config_cleanup(&cfg);
}

static void test_file_and_env(void)
{
    sp_config_t cfg;
    sp_err_t e = SP_ERR_INIT;
    char path[] = "/tmp/spd-conf-XXXXXX";
    int fd = mkstemp(path);
    CHECK(fd >= 0);
    FILE *f = fdopen(fd, "w");
    fprintf(f, "# comment\n\n  op_timeout_ms   1500  \nnode_name \"node a\"\nlog_file \"\"\n");
    fclose(f);

    sp_config_init(&cfg);
    setenv("SPD_OP_TIMEOUT_MS", "2500", 1);
    CHECK_EQ(sp_config_load_file(&cfg, path, &e), SPC_OK);
    CHECK_EQ(cfg.op_timeout_ms, 1500);
    CHECK_STREQ(cfg.node_name, "node a");
    CHECK_EQ(sp_config_load_env(&cfg, &e), SPC_OK);   /* environment wins over the file */
    CHECK_EQ(cfg.op_timeout_ms, 2500);
    size_t idx;
    sp_config_find("op_timeout_ms", &idx);
    CHECK_EQ(cfg.source[idx], SP_SRC_ENV);
    unsetenv("SPD_OP_TIMEOUT_MS");

    f = fopen(path, "w");
    fprintf(f, "op_timeout_ms 10\nsq_entries\n");
    fclose(f);
    CHECK_EQ(sp_config_load_file(&cfg, path, &e), SPC_ERR_INVALID_ARG);
    CHECK_CONTAINS(e.msg, ":2: option 'sq_entries' has no value");
    f = fopen(path, "w");
    fprintf(f, "\nbogus 1\n");
    fclose(f);
    CHECK_EQ(sp_config_load_file(&cfg, path, &e), SPC_ERR_NOT_FOUND);
    CHECK_CONTAINS(e.msg, ":2: unknown option 'bogus'");
    unlink(path);
    sp_config_cleanup(&cfg);
}

/* deploy/spd.conf must be the documented default dump, byte for byte, after its header. */
static void test_shipped_conf(void)
{
    char path[512];
    snprintf(path, sizeof path, "%s/deploy/spd.conf", SP_SOURCE_DIR);
    FILE *f = fopen(path, "r");
    CHECK(f != NULL);
    static char file[65536];
    size_t n = fread(file, 1, sizeof file - 1, f);
    fclose(f);
    file[n] = '\0';
    const char *marker = "# ---- options ----\n";
    char *body = strstr(file, marker);
    CHECK(body != NULL);
    body += strlen(marker);

    sp_config_t cfg;
    sp_config_init(&cfg);
    char *dump = NULL;
    size_t dlen = 0;
    FILE *m = open_memstream(&dump, &dlen);
    sp_config_dump(&cfg, m, 1);
    fclose(m);
    if (strcmp(body, dump) != 0) {
        fprintf(stderr, "deploy/spd.conf is out of step with the option table; regenerate the part below the "
                        "marker with `env -i build/daemon/spd --dump-config`\n--- expected ---\n%s", dump);
        SP_FAIL("deploy/spd.conf differs from the option table");
    }
    /* And it loads, setting every option to its default. */
    sp_err_t e = SP_ERR_INIT;
    CHECK_EQ(sp_config_load_file(&cfg, path, &e), SPC_OK);
    size_t count;
    const sp_option_t *opts = sp_config_options(&count);
    char buf[4200];
    for (size_t i = 0; i < count; i++) {
        CHECK_EQ(cfg.source[i], SP_SRC_FILE);
        sp_config_format(&cfg, i, buf, sizeof buf);
        CHECK_STREQ(buf, opts[i].def);
    }
    free(dump);
    sp_config_cleanup(&cfg);
}

/* Every disagreement is found in one pass and names its options; the defaults agree. */
static void test_check(void)
{
    sp_config_t cfg;
    sp_err_t e = SP_ERR_INIT;
    char out[4096];

    sp_config_init(&cfg);
    CHECK_EQ(sp_config_check(&cfg, out, sizeof out), 0);
    CHECK_STREQ(out, "");
    const char *bad[][2] = {
        { "peers", "10.0.0.2:7341" },
        { "metrics_listen", "0.0.0.0:9464" },
        { "reply_pause_bytes", "8M" },
        { "max_reply_bytes", "4M" },
        { "arena_bytes", "2G" },
        { "max_arena_bytes", "1G" },
        { "peer_max_pending", "4" },
        { "peer_max_pending_per_addr", "8" },
        { "peer_heartbeat_ms", "5000" },
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        CHECK_EQ(sp_config_set(&cfg, bad[i][0], bad[i][1], SP_SRC_CMDLINE, &e), SPC_OK);
    CHECK_EQ(sp_config_check(&cfg, out, sizeof out), 6);
    CHECK_CONTAINS(out, "peer_listen and peers need cluster_secret_file");
    CHECK_CONTAINS(out, "metrics_listen '0.0.0.0:9464' is not a loopback address");
    CHECK_CONTAINS(out, "reply_pause_bytes (8M) is above max_reply_bytes (4M)");
    CHECK_CONTAINS(out, "arena_bytes (2G) is above max_arena_bytes (1G)");
    CHECK_CONTAINS(out, "peer_max_pending_per_addr (8) is above peer_max_pending (4)");
    CHECK_CONTAINS(out, "peer_timeout_ms (5000) is not above peer_heartbeat_ms (5000)");
    CHECK(out[strlen(out) - 1] != '\n');
    /* Each fixed, one by one, takes its line away. */
    CHECK_EQ(sp_config_set(&cfg, "metrics_allow_remote", "1", SP_SRC_CMDLINE, &e), SPC_OK);
    CHECK_EQ(sp_config_set(&cfg, "cluster_secret_file", "/etc/spd/secret", SP_SRC_CMDLINE, &e), SPC_OK);
    CHECK_EQ(sp_config_check(&cfg, out, sizeof out), 4);
    CHECK(strstr(out, "cluster_secret_file") == NULL && strstr(out, "metrics_listen") == NULL);
    sp_config_cleanup(&cfg);
}

/* A reload takes the live options and names the others. */
static void test_apply_live(void)
{
    sp_config_t run, next;
    sp_err_t e = SP_ERR_INIT;
    char restart[256];

    sp_config_init(&run);
    sp_config_init(&next);
    CHECK_EQ(sp_config_set(&next, "log_level", "debug", SP_SRC_FILE, &e), SPC_OK);
    CHECK_EQ(sp_config_set(&next, "log_file", "/var/log/spd/spd.log", SP_SRC_FILE, &e), SPC_OK);
    CHECK_EQ(sp_config_set(&next, "op_timeout_ms", "1234", SP_SRC_ENV, &e), SPC_OK);
    CHECK_EQ(sp_config_set(&next, "node_name", "other", SP_SRC_FILE, &e), SPC_OK);
    CHECK_EQ(sp_config_set(&next, "peers", "10.0.0.2:7341", SP_SRC_FILE, &e), SPC_OK);
    CHECK_EQ(sp_config_apply_live(&run, &next, restart, sizeof restart), 3);
    CHECK_EQ(run.log_level, SP_LOG_DEBUG);
    CHECK_STREQ(run.log_file, "/var/log/spd/spd.log");
    CHECK_EQ(run.op_timeout_ms, 1234);
    size_t idx;
    sp_config_find("op_timeout_ms", &idx);
    CHECK_EQ(run.source[idx], SP_SRC_ENV);
    CHECK_STREQ(run.node_name, "");
    CHECK_STREQ(run.peers, "");
    CHECK_STREQ(restart, "node_name, peers");
    CHECK_EQ(sp_config_apply_live(&run, &next, restart, sizeof restart), 0);
    sp_config_cleanup(&next);
    sp_config_cleanup(&run);
}

int main(void)
{
    test_defaults_roundtrip();
    test_errors();
    test_file_and_env();
    test_shipped_conf();
    test_check();
    test_apply_live();
    printf("config: ok\n");
    return 0;
}
