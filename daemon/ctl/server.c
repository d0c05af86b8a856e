/*
 * server.c — spd's control plane on the libuv loop: start-up, signals, the
 * systemd watchdog, the drain and shutdown.
 *
 * sp_server_init binds the socket (once its directory is checked and no other
 * spd serves it), starts the metrics endpoint and the links to peers, and gives
 * the engine an async to wake the loop with; when a step from the bind on
 * fails it undoes the ones before, in reverse. SIGTERM or SIGINT drains (no new sessions; ops in
 * flight may finish within drain_timeout_ms), a second one stops at once;
 * SIGHUP reads the configuration again, applies what can change live and
 * reopens the log. Sessions are session.c, requests handlers.c, spctl's
 * questions query.c, joins and jobs across daemons cluster_jobs.c.
 */
#include "ctl/server.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "core/auth.h"
#include "core/engine.h"
#include "core/job.h"
#include "ctl/cluster_jobs.h"
#include "ctl/cluster_names.h"
#include "ctl/session.h"
#include "base/log.h"
#include "obs/metrics.h"
#include "base/notify.h"
#include "cluster/net.h"
#include "cluster/sp_nccl.h"

/* ================================================================ signals, drain, watchdog */

static void on_handle_closed_noop(uv_handle_t *h)
{
    (void)h;
}

static void on_signals_closed(uv_handle_t *h)
{
    sp_server_t *srv = h->data;
    close(srv->signal_fd);
    srv->signal_fd = -1;
}

static void server_finish_shutdown(sp_server_t *srv)
{
    if (srv->closing)
        return;
    srv->closing = true;

    pthread_mutex_lock(&srv->eng->lock);
    uint32_t left = sp_engine_inflight_locked(srv->eng);
    sp_engine_shutdown_locked(srv->eng);
    pthread_mutex_unlock(&srv->eng->lock);
    sp_info(CORE, "shutting down (%u ops failed as unfinished)", left);

    while (srv->sessions != NULL)
        sp_session_close(srv->sessions, "spd shutting down");
    sp_peers_close(&srv->peers);
    sp_metrics_http_close(srv->metrics_http);
    srv->metrics_http = NULL;
    if (srv->net_polling) {
        uv_close((uv_handle_t *)&srv->net_poll, on_handle_closed_noop);
        uv_close((uv_handle_t *)&srv->grace_timer, on_handle_closed_noop);
        srv->net_polling = false;
    }
    sp_names_close(srv);
    if (srv->listening) {
        uv_close((uv_handle_t *)&srv->listener, on_handle_closed_noop);
        unlink(srv->socket_path);
        srv->listening = false;
    }
    uv_close((uv_handle_t *)&srv->signals, on_signals_closed);
    uv_close((uv_handle_t *)&srv->watchdog, on_handle_closed_noop);
    uv_close((uv_handle_t *)&srv->drain_timer, on_handle_closed_noop);
    uv_close((uv_handle_t *)&srv->async, on_handle_closed_noop);
}

static void on_drain_timeout(uv_timer_t *t)
{
    sp_server_t *srv = t->data;
    sp_warn(CORE, "drain timeout (%" PRId64 " ms) reached with ops in flight", srv->cfg->drain_timeout_ms);
    server_finish_shutdown(srv);
}

/* SIGTERM: stop taking new work, let in-flight ops finish, then exit 0. */
static void server_begin_drain(sp_server_t *srv, const char *why)
{
    if (srv->draining) {
        sp_info(CORE, "%s again: stopping now", why);
        server_finish_shutdown(srv);
        return;
    }
    srv->draining = true;
    sp_info(CORE, "%s: draining (no new connections; in-flight ops may finish)", why);
    sp_notify("STOPPING=1");
    if (srv->listening) {
        uv_close((uv_handle_t *)&srv->listener, on_handle_closed_noop);
        unlink(srv->socket_path);
        srv->listening = false;
    }
    sp_engine_drain(srv->eng);   /* the progress thread reports "drained" through the async */
    uv_timer_start(&srv->drain_timer, on_drain_timeout, (uint64_t)srv->cfg->drain_timeout_ms, 0);
}

/*
 * SIGUSR2: stop so that the next spd (a new binary, say) takes the clients
 * over with their jobs (docs/operations.md, "Upgrade and drain"). Nothing is
 * drained or failed and no segment is let go: the progress thread stops
 * between two passes, so every completion it posted is whole, and the process
 * exits at once with SP_EXIT_RESTART, its sessions ending with it. Its clients
 * come back to the next spd on the socket (libspclient, SPC_RECONNECT_MS).
 * Closing the sessions one by one, as a drain does, would tell each job that
 * its ranks were lost.
 */
static void server_stop_for_restart(sp_server_t *srv)
{
    sp_info(CORE, "SIGUSR2: stopping for a restart; clients keep their jobs and come back to the next spd");
    sp_notify("STOPPING=1");
    sp_engine_halt(srv->eng);   /* the lock it returns with is kept to the exit */
    sp_log_close();
    _exit(SP_EXIT_RESTART);
}

/* The log's options, from cfg: the file (opened again, after logrotate moved
 * it, or another one), then the level, subsystems and format. */
static void log_apply(const sp_config_t *cfg, bool file_changed)
{
    atomic_store(&sp_log_level, (int)cfg->log_level);
    atomic_store(&sp_log_mask, (uint32_t)cfg->log_subsys);
    atomic_store(&sp_log_format, (int)cfg->log_format);
    int rc = file_changed ? sp_log_open(cfg->log_file) : sp_log_reopen();
    if (rc != 0)
        sp_error(CORE, "SIGHUP: cannot open the log file %s: %s; logging where it did", cfg->log_file, strerror(-rc));
    else
        sp_info(CORE, "SIGHUP: log reopened");
}

void sp_server_reload(sp_server_t *srv)
{
    sp_config_t next;
    sp_err_t e = SP_ERR_INIT;
    char problems[4096], restart_only[1024];

    if (sp_config_resolve(&next, srv->cfg_args, &e) != SPC_OK) {
        sp_error(CFG, "SIGHUP: %s; the running configuration is kept", e.msg);
        log_apply(srv->cfg, false);
        goto out;
    }
    int bad = sp_config_check(&next, problems, sizeof problems);
    if (bad > 0) {
        for (char *sv, *line = strtok_r(problems, "\n", &sv); line != NULL; line = strtok_r(NULL, "\n", &sv))
            sp_error(CFG, "SIGHUP: %s", line);
        sp_error(CFG, "SIGHUP: %d problem%s in the configuration; the running one is kept", bad, bad > 1 ? "s" : "");
        log_apply(srv->cfg, false);
        goto out;
    }
    bool file_changed = strcmp(next.log_file, srv->cfg->log_file) != 0;
    /* The engine's threads read the live options under its lock. */
    pthread_mutex_lock(&srv->eng->lock);
    int changed = sp_config_apply_live(srv->cfg, &next, restart_only, sizeof restart_only);
    pthread_mutex_unlock(&srv->eng->lock);
    log_apply(srv->cfg, file_changed);
    if (changed < 0)
        sp_error(CFG, "SIGHUP: out of memory applying the configuration; some options may keep their values");
    else
        sp_info(CFG, "SIGHUP: configuration read again: %d option%s changed%s%s", changed, changed == 1 ? "" : "s",
                restart_only[0] ? "; these differ but change only at a restart: " : "", restart_only);
out:
    sp_config_cleanup(&next);
}

/*
 * The signals spd acts on. main() blocks them before any thread exists, so
 * every thread (copy workers, the progress thread, UCX's and NCCL's) inherits
 * the block and the kernel holds them for the process; the loop reads them from
 * a signalfd, as one more event. No handler then runs on whichever thread the
 * kernel picks: with libuv's handlers, a ThreadSanitizer build deferred a
 * SIGTERM that came just after start-up and sometimes never ran it at all
 * (an idle spd did not stop).
 */
static void server_signals(sigset_t *set)
{
    sigemptyset(set);
    sigaddset(set, SIGTERM);
    sigaddset(set, SIGINT);
    sigaddset(set, SIGHUP);
    sigaddset(set, SIGUSR2);
}

void sp_server_block_signals(void)
{
    sigset_t set;
    server_signals(&set);
    pthread_sigmask(SIG_BLOCK, &set, NULL);
}

static void on_signal(sp_server_t *srv, int signum)
{
    if (signum == SIGHUP) {
        sp_server_reload(srv);
        return;
    }
    if (signum == SIGUSR2) {
        server_stop_for_restart(srv);
        return;
    }
    server_begin_drain(srv, signum == SIGTERM ? "SIGTERM" : "SIGINT");
}

/* The signals waiting on the signalfd, in the loop like any other event. */
static void on_signals(uv_poll_t *p, int status, int events)
{
    (void)events;
    sp_server_t *srv = p->data;
    struct signalfd_siginfo si;
    if (status < 0) {
        sp_error(CORE, "signals: %s; spd no longer sees SIGTERM, SIGHUP or SIGUSR2", uv_strerror(status));
        uv_poll_stop(p);
        return;
    }
    while (!uv_is_closing((uv_handle_t *)p) && read(srv->signal_fd, &si, sizeof si) == (ssize_t)sizeof si)
        on_signal(srv, (int)si.ssi_signo);
}

/* Progress → loop: doomed clients and "drained", handed over under the lock. */
static void on_async(uv_async_t *a)
{
    sp_server_t *srv = a->data;
    uint64_t ids[64];
    uint32_t n;
    bool drained;

    do {
        pthread_mutex_lock(&srv->eng->lock);
        sp_engine_events_t *ev = &srv->eng->events;
        n = ev->ndoomed < 64 ? ev->ndoomed : 64;
        if (n > 0) {
            memcpy(ids, ev->doomed_ids, n * sizeof ids[0]);
            memmove(ev->doomed_ids, ev->doomed_ids + n, (ev->ndoomed - n) * sizeof ids[0]);
            ev->ndoomed -= n;
        }
        drained = ev->drained;
        pthread_mutex_unlock(&srv->eng->lock);

        for (uint32_t i = 0; i < n; i++) {
            for (sp_session_t *s = srv->sessions; s != NULL; s = s->next) {
                if (s->client != NULL && s->client->id == ids[i]) {
                    /* Set with the doom, under the lock taken above. */
                    sp_session_reply_err(s, 0, &s->client->doom);
                    sp_session_close_after_flush(s, s->client->doom.msg);
                    break;
                }
            }
        }
    } while (n == 64);

    sp_nccl_outbox_drain(srv->eng, sp_cluster_send_nccl_id, srv);

    /* A node whose data path broke its bounds loses its links (and so its jobs). */
    char node[SP_NODE_MAX], why[SP_DETAIL_BYTES];
    for (;;) {
        pthread_mutex_lock(&srv->eng->lock);
        bool broken = sp_net_take_broken(srv->eng, node, sizeof node, why, sizeof why);
        pthread_mutex_unlock(&srv->eng->lock);
        if (!broken)
            break;
        sp_peers_drop(&srv->peers, node, why);
    }

    if (drained && srv->draining) {
        sp_info(CORE, "drained: no ops in flight");
        server_finish_shutdown(srv);
    }
}

static void engine_notify(void *arg)
{
    uv_async_send(arg);
}

static void on_watchdog(uv_timer_t *t)
{
    sp_server_t *srv = t->data;
    uint64_t beat = atomic_load(&srv->eng->heartbeat);
    if (beat == srv->watchdog_beat) {
        /* The progress thread has not been round since the last tick: let the
         * service manager's watchdog fire instead of pretending all is well. */
        sp_error(CORE, "progress thread made no pass in %" PRIu64 " ms; not feeding the watchdog",
                 srv->watchdog_usec / 2000);
        return;
    }
    srv->watchdog_beat = beat;
    sp_notify("WATCHDOG=1");
}

/* ================================================================ setup */

/* A step of start-up failed: the error in e, logged where it is seen. Returns st. */
static spc_status_t setup_failed(sp_err_t *e, spc_status_t st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static spc_status_t setup_failed(sp_err_t *e, spc_status_t st, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    sp_err_vset(e, st, fmt, ap);
    va_end(ap);
    sp_error(CORE, "%s", e->msg);
    return st;
}

/*
 * Creates the socket's directory with `mode` (and group gid), or checks the
 * existing one. A directory spd did not create keeps its mode and group: it
 * may be a runtime directory systemd made, or a host path a container runtime
 * mounted and others share, and its mode is theirs to set. It must be spd's own
 * and writable by nobody else, who could otherwise replace the socket.
 */
static spc_status_t prepare_dir(const char *sock, mode_t mode, long gid, sp_err_t *e)
{
    char dir[sizeof ((struct sockaddr_un *)0)->sun_path];
    snprintf(dir, sizeof dir, "%s", sock);
    char *slash = strrchr(dir, '/');
    if (slash == NULL || slash == dir)
        return setup_failed(e, SPC_ERR_INVALID_ARG, "socket path %s must be absolute and inside a directory", sock);
    *slash = '\0';

    /* Create missing parents as well (XDG_RUNTIME_DIR exists; /tmp/spd-uid may not). */
    for (char *p = dir + 1; (p = strchr(p, '/')) != NULL; p++) {
        *p = '\0';
        mkdir(dir, 0755);
        *p = '/';
    }
    bool created = mkdir(dir, mode) == 0;
    if (!created && errno != EEXIST)
        return setup_failed(e, SPC_ERR_PERMISSION, "cannot create %s: %s", dir, strerror(errno));
    struct stat st;
    if (stat(dir, &st) != 0 || !S_ISDIR(st.st_mode))
        return setup_failed(e, SPC_ERR_INVALID_ARG, "%s is not a directory", dir);
    if (st.st_uid != geteuid())
        return setup_failed(e, SPC_ERR_PERMISSION, "runtime directory %s belongs to uid %u, not to spd's uid %u", dir,
                            (unsigned)st.st_uid, (unsigned)geteuid());
    if (st.st_mode & S_ISVTX)
        return setup_failed(e, SPC_ERR_PERMISSION, "%s is a shared directory (sticky bit); give spd a directory of its "
                            "own", dir);
    if (!created) {
        if (st.st_mode & (S_IWGRP | S_IWOTH))
            return setup_failed(e, SPC_ERR_PERMISSION, "%s is writable by other users (mode %04o), who could replace "
                                "spd's socket; make it %04o, or let spd create it", dir,
                                (unsigned)(st.st_mode & 07777), (unsigned)mode);
        if (gid != SP_AUTH_NO_GROUP && (st.st_gid != (gid_t)gid || !(st.st_mode & S_IXGRP)))
            sp_warn(CORE, "%s (group %u, mode %04o) does not let allow_group (gid %ld) reach the socket; spd leaves "
                    "a directory it did not create as it is", dir, (unsigned)st.st_gid, (unsigned)(st.st_mode & 07777),
                    gid);
        return SPC_OK;
    }
    if (gid != SP_AUTH_NO_GROUP && chown(dir, (uid_t)-1, (gid_t)gid) != 0)
        return setup_failed(e, SPC_ERR_PERMISSION, "cannot give %s to group %ld: %s", dir, gid, strerror(errno));
    /* The umask may have taken bits mode asks for. */
    if ((st.st_mode & 07777) != mode && chmod(dir, mode) != 0)
        return setup_failed(e, SPC_ERR_PERMISSION, "cannot chmod %s to %o: %s", dir, (unsigned)mode, strerror(errno));
    return SPC_OK;
}

/*
 * The node's resume key (core/auth.h, tickets): read from the socket's path
 * with ".key" added, or made there, 32 random bytes, the first time. It must
 * outlive spd (the next spd reads it from the socket's directory, which the
 * unit keeps across restarts) and be spd's alone: a file of another owner, of
 * other modes or of another size is replaced, which voids the tickets of the
 * spd before and costs only the jobs that a restart would have ended anyway.
 * Where no key can be kept, joins carry no ticket and no job outlives spd.
 */
static void resume_key_load(sp_server_t *srv)
{
    sp_engine_t *eng = srv->eng;
    char path[sizeof srv->socket_path + 8];
    struct stat st;

    snprintf(path, sizeof path, "%s.key", srv->socket_path);
    int fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    if (fd >= 0 && fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_uid == geteuid() && (st.st_mode & 077) == 0 &&
        st.st_size == SP_AUTH_KEY_BYTES && read(fd, eng->resume_key, SP_AUTH_KEY_BYTES) == SP_AUTH_KEY_BYTES) {
        close(fd);
        eng->resume_key_set = true;
        sp_info(CORE, "resume key %s: the clients of the spd before this one may come back with their jobs", path);
        return;
    }
    if (fd >= 0) {
        close(fd);
        sp_warn(CORE, "resume key %s is not spd's own file of mode 0600 and %u bytes: replacing it (jobs of the spd "
                "before cannot come back)", path, SP_AUTH_KEY_BYTES);
    }
    unlink(path);
    if (getrandom(eng->resume_key, SP_AUTH_KEY_BYTES, 0) != SP_AUTH_KEY_BYTES) {
        sp_warn(CORE, "no randomness for a resume key: jobs end when spd does");
        return;
    }
    fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0 || write(fd, eng->resume_key, SP_AUTH_KEY_BYTES) != SP_AUTH_KEY_BYTES) {
        sp_warn(CORE, "cannot write the resume key %s (%s): jobs end when spd does", path, strerror(errno));
        if (fd >= 0) {
            close(fd);
            unlink(path);
        }
        return;
    }
    close(fd);
    eng->resume_key_set = true;
    sp_info(CORE, "resume key %s made: jobs outlive a restart of spd", path);
}

/* A socket file already there: another spd answering on it, or a stale one. */
static spc_status_t check_stale_socket(const char *path, sp_err_t *e)
{
    struct stat st;
    if (lstat(path, &st) != 0)
        return SPC_OK;
    if (!S_ISSOCK(st.st_mode))
        return setup_failed(e, SPC_ERR_INVALID_ARG, "%s exists and is not a socket", path);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_un sa = { .sun_family = AF_UNIX };
    snprintf(sa.sun_path, sizeof sa.sun_path, "%s", path);
    int rc = connect(fd, (struct sockaddr *)&sa, sizeof sa);
    close(fd);
    if (rc == 0)
        return setup_failed(e, SPC_ERR_BUSY, "another spd is already serving %s", path);
    sp_info(CORE, "removing stale socket %s", path);
    unlink(path);
    return SPC_OK;
}

sp_metrics_source_t sp_server_metrics_source(sp_server_t *srv)
{
    return (sp_metrics_source_t){ .eng = srv->eng, .peers = &srv->peers, .devices = &srv->devices,
                                  .cfg = srv->cfg, .sessions = &srv->nsessions,
                                  .name_lookups = &srv->nlookups, .refused = srv->refused,
                                  .protocol_max = srv->protocol_max, .by_protocol = srv->by_protocol,
                                  .loop = srv->loop, .started_ns = srv->started_ns };
}

spc_status_t sp_server_init(sp_server_t *srv, uv_loop_t *loop, sp_engine_t *eng, sp_config_t *cfg,
                            const sp_config_args_t *cfg_args, const char *node, const char *socket_path, sp_err_t *e)
{
    spc_status_t st;

    memset(srv, 0, sizeof *srv);
    srv->loop = loop;
    srv->eng = eng;
    srv->cfg = cfg;
    srv->cfg_args = cfg_args;
    srv->started_ns = sp_now_ns();
    srv->protocol_max = cfg->protocol_max != 0 ? (uint32_t)cfg->protocol_max : SP_PROTOCOL_VERSION;
    snprintf(srv->node, sizeof srv->node, "%s", node);
    if (strlen(socket_path) >= sizeof srv->socket_path)
        return setup_failed(e, SPC_ERR_INVALID_ARG, "socket path too long (%zu bytes; at most %zu)",
                            strlen(socket_path), sizeof srv->socket_path - 1);
    snprintf(srv->socket_path, sizeof srv->socket_path, "%s", socket_path);
    if (sp_auth_resolve_group(cfg->allow_group, &srv->allow_gid) != 0) {
        sp_err_set(e, SPC_ERR_NOT_FOUND, "allow_group: no group '%s'", cfg->allow_group);
        sp_error(CFG, "%s", e->msg);
        return e->status;
    }
    sp_devices_probe(&srv->devices, cfg->nccl_library);
    /* The engine's way to imports and streams (core/transport.h). */
    if ((st = sp_gpu_install(eng, e)) != SPC_OK) {
        sp_error(CORE, "%s", e->msg);
        return st;
    }
    /* Before the data path's threads start: it may set NCCL_HOSTID. */
    sp_nccl_setup(eng, cfg->nccl_library, srv->devices.nccl, srv->devices.gpu_count);

    bool group = srv->allow_gid != SP_AUTH_NO_GROUP;
    SP_CHECK(prepare_dir(srv->socket_path, group ? 0710 : 0700, srv->allow_gid, e));
    SP_CHECK(check_stale_socket(srv->socket_path, e));
    resume_key_load(srv);

    uv_pipe_init(loop, &srv->listener, 0);
    srv->listener.data = srv;
    int rc = uv_pipe_bind(&srv->listener, srv->socket_path);
    if (rc == 0 && chmod(srv->socket_path, group ? 0660 : 0600) != 0)
        rc = -errno;
    if (rc == 0 && group && chown(srv->socket_path, (uid_t)-1, (gid_t)srv->allow_gid) != 0)
        rc = -errno;
    if (rc == 0)
        rc = uv_listen((uv_stream_t *)&srv->listener, 128, sp_session_accept);
    if (rc != 0) {
        st = setup_failed(e, SPC_ERR_PERMISSION, "cannot listen on %s: %s", srv->socket_path, uv_strerror(rc));
        goto err_close_listener;
    }
    srv->listening = true;
    sp_metrics_source_t metrics = sp_server_metrics_source(srv);
    SP_CHECK_GOTO(sp_metrics_http_start(&metrics, &srv->metrics_http, e), st, err_unlink_socket);
    sigset_t signals;
    server_signals(&signals);
    srv->signal_fd = signalfd(-1, &signals, SFD_NONBLOCK | SFD_CLOEXEC);
    if (srv->signal_fd < 0) {
        st = setup_failed(e, SPC_ERR_NO_MEMORY, "cannot read signals (signalfd): %s", strerror(errno));
        goto err_close_metrics;
    }
    if (sp_cluster_init(srv) != 0) {   /* the peer links and the data path said why */
        st = sp_err_set(e, SPC_ERR_TRANSPORT, "the links to other daemons did not start");
        goto err_close_signals;
    }

    uv_async_init(loop, &srv->async, on_async);
    srv->async.data = srv;
    eng->notify = engine_notify;
    eng->notify_arg = &srv->async;

    uv_poll_init(loop, &srv->signals, srv->signal_fd);
    srv->signals.data = srv;
    uv_poll_start(&srv->signals, UV_READABLE, on_signals);

    uv_timer_init(loop, &srv->drain_timer);
    srv->drain_timer.data = srv;
    uv_timer_init(loop, &srv->watchdog);
    srv->watchdog.data = srv;
    srv->watchdog_usec = sp_notify_watchdog_usec();
    if (srv->watchdog_usec > 0) {
        uint64_t every_ms = srv->watchdog_usec / 2000;
        if (every_ms == 0)
            every_ms = 1;
        uv_timer_start(&srv->watchdog, on_watchdog, every_ms, every_ms);
        /* The progress thread must go round at least once per tick, even idle. */
        eng->max_sleep_ns = (int64_t)(srv->watchdog_usec * 1000 / 4);
        sp_info(CORE, "watchdog: every %" PRIu64 " ms", every_ms);
    }
    sp_info(CORE, "listening on %s", srv->socket_path);
    return SPC_OK;

err_close_signals:
    close(srv->signal_fd);
err_close_metrics:
    sp_metrics_http_close(srv->metrics_http);
err_unlink_socket:
    unlink(srv->socket_path);
err_close_listener:
    uv_close((uv_handle_t *)&srv->listener, NULL);
    uv_run(loop, UV_RUN_NOWAIT);   /* runs the close callbacks: nothing of the server stays on the loop */
    return st;
}

int sp_server_run(sp_server_t *srv)
{
    sp_notify("READY=1");
    return uv_run(srv->loop, UV_RUN_DEFAULT);
}
