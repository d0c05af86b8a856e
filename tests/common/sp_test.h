/*
 * sp_test.h — what the tests share: assertions that print both sides, a real spd
 * started and stopped per test, and child processes for ranks.
 *
 * Each test is its own program; exit 0 passes, 77 skips (with the reason on
 * stderr), anything else fails. A failed check in a child exits that child with 1
 * and the parent's check of its exit status fails the test.
 */
#ifndef SP_TEST_H
#define SP_TEST_H

#include <inttypes.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <unistd.h>

#include "spclient/spclient.h"

#define SP_TEST_SKIP 77

#define SP_FAIL(...)                                                                   \
    do {                                                                               \
        fprintf(stderr, "FAIL %s:%d (pid %d): ", __FILE__, __LINE__, (int)getpid());   \
        fprintf(stderr, __VA_ARGS__);                                                  \
        fputc('\n', stderr);                                                           \
        sp_test_on_fail();                                                             \
        exit(1);                                                                       \
    } while (0)

/* Called by a failing check: in the process that started spd, prints its log and
 * kills it, so that nothing outlives the test. */
void sp_test_on_fail(void);

#define CHECK(cond)                                                                    \
    do {                                                                               \
        if (!(cond))                                                                   \
            SP_FAIL("%s", #cond);                                                      \
    } while (0)

#define CHECK_EQ(a, b)                                                                 \
    do {                                                                               \
        long long a_ = (long long)(a), b_ = (long long)(b);                            \
        if (a_ != b_)                                                                  \
            SP_FAIL("%s == %s: %lld != %lld", #a, #b, a_, b_);                         \
    } while (0)

#define CHECK_STREQ(a, b)                                                              \
    do {                                                                               \
        const char *a_ = (a), *b_ = (b);                                               \
        if (strcmp(a_, b_) != 0)                                                       \
            SP_FAIL("%s == %s: \"%s\" != \"%s\"", #a, #b, a_, b_);                     \
    } while (0)

#define CHECK_CONTAINS(hay, needle)                                                    \
    do {                                                                               \
        const char *h_ = (hay), *n_ = (needle);                                        \
        if (strstr(h_, n_) == NULL)                                                    \
            SP_FAIL("\"%s\" does not contain \"%s\"", h_, n_);                         \
    } while (0)

/* Checks a status; on mismatch prints both names and the handle's last error. */
#define CHECK_ST(h, call, expected)                                                    \
    do {                                                                               \
        spc_status_t got_ = (call), want_ = (expected);                                \
        if (got_ != want_)                                                             \
            SP_FAIL("%s: got %s, expected %s (detail: %s)", #call, spc_status_name(got_), \
                    spc_status_name(want_), spc_last_error(h));                        \
    } while (0)

#define CHECK_OK(h, call) CHECK_ST(h, call, SPC_OK)

/* A real spd in a private directory. */
typedef struct sp_test_daemon {
    pid_t pid;
    char  dir[128];         /* mkdtemp'd; removed by sp_test_daemon_cleanup */
    char  sock[192];
    char  log[192];
    char  notify[192];
    int   notify_fd;
} sp_test_daemon_t;

/* Puts dir first in LD_LIBRARY_PATH, so that the spd this process starts finds
 * the stand-in CUDA driver (tests/stubcuda) where the test found it. */
void sp_test_use_stub_cuda(const char *dir);

/* Starts spd with --set socket=<dir>/run/spd.sock, log_file=<dir>/spd.log and the
 * given extra arguments (NULL-terminated, may be NULL), and waits for READY=1.
 * Sets SPC_SOCKET for this process and its children. Fails the test on error. */
void sp_test_daemon_start(sp_test_daemon_t *d, const char *const *extra_args);
/* Like start, but runs spd through `wrapper` (e.g. setpriv ...) and env. */
void sp_test_daemon_start_ex(sp_test_daemon_t *d, const char *const *wrapper, const char *const *extra_args);
/* Waits for a notify datagram containing `state` (e.g. "STOPPING=1"). Returns
 * true when it came within timeout_ms. */
bool sp_test_notify_wait(sp_test_daemon_t *d, const char *state, int timeout_ms);
/* Starts spd again in d's directory, on the same socket, once the last one is
 * gone (d->pid == 0: stopped, or killed and reaped). */
void sp_test_daemon_restart(sp_test_daemon_t *d, const char *const *extra_args);
/* SIGTERM, then waits; returns the exit code (-signal if killed). */
int sp_test_daemon_stop(sp_test_daemon_t *d);
/* Removes the directory (after stop or kill). */
void sp_test_daemon_cleanup(sp_test_daemon_t *d);
/* Prints the daemon's log to stderr (for failures). */
void sp_test_daemon_dump_log(const sp_test_daemon_t *d);

/* Forks a child running fn(arg); its return value is its exit code. */
pid_t sp_test_fork(int (*fn)(void *arg), void *arg);
/* Waits for a child up to timeout_ms; returns its exit code, -signal, or -1000 on
 * timeout (the child is then killed). */
int sp_test_wait(pid_t pid, int timeout_ms);
/* Waits for every child and checks that each exited 0. */
void sp_test_wait_all_ok(const pid_t *pids, int n, int timeout_ms);

/* Memory shared with children (MAP_SHARED | MAP_ANONYMOUS), for results. */
void *sp_test_shared(size_t bytes);

/* Makes the calling process (a forked rank, run as root) user `uid` with
 * `gid` as its only group: a stranger, or another user of a shared group. */
void sp_test_become(uid_t uid, gid_t gid);

/* `spctl status`'s integer field `key`, read through h (the test fails when
 * there is no such field). */
int64_t sp_test_status_int(spc_handle_t *h, const char *key);
/* Polls `spctl status`'s integer field `key` through h until it reads `want`;
 * returns whether it did within timeout_ms. */
bool sp_test_wait_status(spc_handle_t *h, const char *key, int64_t want, int timeout_ms);

/* Polls `spctl jobs`'s `joined` count of job_id through h until it reads want
 * (-1: until the job is gone); returns whether it did within timeout_ms. It
 * queries at least once, so a timeout of 0 checks the count as it is. */
bool sp_test_wait_job_joined(spc_handle_t *h, const char *job_id, int64_t want, int timeout_ms);

/* Submits op, waits up to timeout_ms and releases the request; returns the op's
 * status (SPC_IN_PROGRESS if it had not completed). */
spc_status_t sp_test_submit_wait(spc_handle_t *h, const spc_op_t *op, int timeout_ms);

/* Attaches with defaults, failing the test on error. */
spc_handle_t *sp_test_attach(void);

uint64_t sp_test_now_ms(void);

/* A TCP connection to 127.0.0.1:port, from from_ip (any 127.x.y.z; NULL: the
 * kernel's choice); the test fails when it cannot connect. */
int  sp_test_tcp_connect(const char *from_ip, int port);
/* Sends len bytes on a new connection from from_ip and reads until the other
 * end closes it; returns the milliseconds that took, or -1 if it had not
 * closed within timeout_ms. */
long sp_test_tcp_closed_after(const char *from_ip, int port, const void *bytes, size_t len, int timeout_ms);

/* A field of /proc/<pid>/status in KiB ("VmRSS", "VmHWM"); the test fails when absent. */
int64_t sp_test_proc_kib(pid_t pid, const char *field);

/* Path of a built program, from the compile definitions SPD_BIN and SPCTL_BIN;
 * SP_TEST_SPD names another spd to start (tests/stubcuda's spd_stub). */
const char *sp_test_spd_bin(void);
const char *sp_test_spctl_bin(void);

/* Runs a command line through /bin/sh, capturing stdout into buf. Returns the exit code. */
int sp_test_run(char *buf, size_t len, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

/* spctl --json output, read by tests. The {...} record of a JSON array around
 * the first `needle` at or after `from` (a pointer into json), copied into out;
 * false when there is none or it does not fit. */
bool sp_test_json_record(const char *json, const char *from, const char *needle, char *out, size_t len);
/* Fields of a record; the test fails when the key is absent. Strings have no escapes. */
long long sp_test_json_int(const char *rec, const char *key);
double sp_test_json_double(const char *rec, const char *key);
void sp_test_json_str(const char *rec, const char *key, char *out, size_t len);

#endif /* SP_TEST_H */

/* ---- raw protocol access, for tests that misbehave on purpose ---- */
#include "sp_msg.h"

/* Connects to the daemon's socket; returns the fd. */
int sp_test_raw_connect(const char *sock);
/* Sends bytes as they are. */
void sp_test_raw_send(int fd, const void *buf, size_t len);
/* Sends one message in a proper frame. */
void sp_test_raw_send_msg(int fd, Spd__Msg *m);
/* Reads one frame's message. Returns NULL at EOF or after timeout_ms; *eof_p
 * (optional) says which. */
Spd__Msg *sp_test_raw_recv(int fd, int timeout_ms, bool *eof_p);
/* Sends a valid client Hello and checks the Welcome (descriptors are dropped). */
void sp_test_raw_hello(int fd, int role);

/* Several daemons on loopback, each playing a node. */

/* Starts spd as node `node` with the cluster secret file `secret`, listening for
 * peers on `listen` ("" for none) and dialling `peers` ("" for none), with
 * heartbeats every 50 ms and a peer silent for peer_timeout_ms marked down. */
void sp_test_node_start(sp_test_daemon_t *d, const char *node, const char *secret, const char *listen,
                        const char *peers, int peer_timeout_ms);
/* The port spd bound for peers (its status's peer_listen). */
int  sp_test_node_port(const sp_test_daemon_t *d);
/* Starts node-0 listening on loopback and node-1 dialling it, both with the
 * secret file `secret` and peer_timeout_ms 5000, and waits until each has the
 * other up. */
void sp_test_node_pair_start(sp_test_daemon_t nodes[2], const char *secret);
/* Stops d where it runs (the test fails unless it exits 0), and removes its directory. */
void sp_test_node_stop(sp_test_daemon_t *d);
/* Stops node-1, then node-0, as sp_test_node_stop. */
void sp_test_node_pair_stop(sp_test_daemon_t nodes[2]);
/* `spctl --json status` of daemon d, into out; the test fails when spctl does. */
void sp_test_node_status(const sp_test_daemon_t *d, char *out, size_t len);
/* How many lines of daemon d's log match the extended regex re. */
int  sp_test_log_count(const sp_test_daemon_t *d, const char *re);
/* Waits until daemon d shows peer `node` in `state` (spctl peers); fails the
 * test after timeout_ms. The JSON record is left in rec. */
void sp_test_peer_wait(const sp_test_daemon_t *d, const char *node, const char *state, int timeout_ms, char *rec,
                       size_t len);
/* How many of daemon d's links to `node` are up (spctl peers). */
int  sp_test_peer_links_up(const sp_test_daemon_t *d, const char *node);
/* Writes a secret file (mode 0600) into dir; its path goes to path. */
void sp_test_secret_file(const char *dir, const char *name, const char *secret, char *path, size_t len);

/* Starts the daemons a test runs against: one (d), or with "--nodes N" in argv
 * N linked on loopback, d being node 0; sp_test_run_job then spreads its ranks
 * over the nodes, contiguously, so the same test checks the same results
 * across daemons. Returns N. */
int  sp_test_start(sp_test_daemon_t *d, int argc, char **argv);
/* Daemon `node` (1 or more) of sp_test_start's cluster, and the path of its secret file. */
const sp_test_daemon_t *sp_test_cluster_daemon(int node);
const char *sp_test_cluster_secret(void);
/* Stops what sp_test_start started beyond d; 0 when every daemon exited 0. */
int  sp_test_cluster_stop(void);

/* Runs one job of `nranks` processes: the parent creates it, each child attaches,
 * joins as its rank and calls fn; the child's exit code is fn's return value.
 * Fails the test if any rank fails. */
typedef int (*sp_test_rank_fn)(spc_handle_t *h, spc_group_t world, int rank, int nranks, void *arg);
void sp_test_run_job(int nranks, sp_test_rank_fn fn, void *arg);
/* The same in a job made beforehand (its creator is the caller's). */
void sp_test_run_job_in(const char *job_id, int nranks, sp_test_rank_fn fn, void *arg);
/* Proof that the daemon still serves: new clients run a 2-rank job whose
 * all-reduce comes out right. Fails the test otherwise. */
void sp_test_daemon_serves(void);
