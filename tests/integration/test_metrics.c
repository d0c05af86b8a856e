/*
 * The Prometheus exposition of a real spd: `spctl metrics` and GET /metrics on
 * metrics_listen give the same text, and that text passes a strict reading of
 * the text format 0.0.4 (below); its counters match the ops a job ran. The
 * endpoint refuses what is not `GET /metrics` (garbage, other methods and
 * paths, a head too long, a client that sends nothing, one connection too
 * many) while spd keeps serving. It is off by default, and a non-loopback
 * address is refused unless metrics_allow_remote says otherwise. With
 * metrics_per_group the groups' series count the job's ops; the sessions,
 * refused attaches, arenas and the process_* families say what the kernel
 * and spctl say. (test_metrics_bounded: what the defaults leave out.)
 */
#include <arpa/inet.h>
#include <errno.h>
#include <math.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include "sp_test.h"

/* ================================================================ a strict reader of the text format */

/*
 * The rules checked (Prometheus exposition formats, text 0.0.4), a few of them
 * this project's conventions on top:
 *   - lines end in \n, the text too; no empty line, no \r;
 *   - `# HELP name text` and `# TYPE name type` at most once per family, the
 *     TYPE before the family's first sample; type counter, gauge or histogram
 *     (spd writes no other); every sample belongs to a TYPEd family;
 *   - a family's lines are together: once another family started, it never
 *     comes back;
 *   - names [a-zA-Z_:][a-zA-Z0-9_:]*, label names [a-zA-Z_][a-zA-Z0-9_]*, not
 *     starting with "__", no label twice; values "..." with only \\ \" \n escaped;
 *   - the value a float (NaN, +Inf, -Inf allowed); no timestamp (spd writes none);
 *   - no series (name and labels) twice;
 *   - counters end in _total and are >= 0 (convention);
 *   - a histogram family F has F_bucket (with le), F_sum and F_count (without),
 *     per label set: le strictly increasing, counts not decreasing, the last
 *     le="+Inf", equal to F_count; F ends in _seconds (convention: durations).
 */

#define PROM_MAX_FAMILIES 128
#define PROM_MAX_SERIES   8192
#define PROM_MAX_HIST     512

typedef struct prom_hist {
    char   key[512];      /* family and labels without le */
    double last_le, last_count, count;
    bool   inf, has_sum, has_count;
} prom_hist_t;

typedef struct prom {
    char        fam[PROM_MAX_FAMILIES][96];
    char        type[PROM_MAX_FAMILIES][16];
    bool        help[PROM_MAX_FAMILIES];
    bool        sampled[PROM_MAX_FAMILIES];
    int         nfam, cur;        /* cur: the family whose lines come now */
    char      (*series)[512];
    int         nseries;
    prom_hist_t hist[PROM_MAX_HIST];
    int         nhist;
    int         samples;
} prom_t;

static bool name_ok(const char *s, size_t n, bool label)
{
    if (n == 0)
        return false;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        bool alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || (!label && c == ':');
        if (!alpha && !(i > 0 && c >= '0' && c <= '9'))
            return false;
    }
    return !(label && n >= 2 && s[0] == '_' && s[1] == '_');
}

static bool float_ok(const char *s, double *v)
{
    if (strcmp(s, "+Inf") == 0 || strcmp(s, "-Inf") == 0 || strcmp(s, "NaN") == 0) {
        *v = strcmp(s, "NaN") == 0 ? NAN : s[0] == '+' ? INFINITY : -INFINITY;
        return true;
    }
    char *end;
    errno = 0;
    *v = strtod(s, &end);
    return *s != '\0' && *end == '\0' && errno == 0 && strspn(s, "0123456789+-.eE") == strlen(s);
}

static int prom_family(prom_t *p, const char *name)
{
    for (int i = 0; i < p->nfam; i++)
        if (strcmp(p->fam[i], name) == 0)
            return i;
    return -1;
}

/* A HELP or TYPE line of family `name`: it must be the current family or a new one. */
static int prom_meta(prom_t *p, const char *name, const char **err)
{
    int f = prom_family(p, name);
    if (f >= 0 && f != p->cur) {
        *err = "a family's lines are not together";
        return -1;
    }
    if (f < 0) {
        if (p->nfam == PROM_MAX_FAMILIES) {
            *err = "too many families";
            return -1;
        }
        f = p->nfam++;
        snprintf(p->fam[f], sizeof p->fam[f], "%s", name);
    }
    p->cur = f;
    return f;
}

static prom_hist_t *prom_hist(prom_t *p, const char *key)
{
    for (int i = 0; i < p->nhist; i++)
        if (strcmp(p->hist[i].key, key) == 0)
            return &p->hist[i];
    if (p->nhist == PROM_MAX_HIST)
        return NULL;
    prom_hist_t *h = &p->hist[p->nhist++];
    memset(h, 0, sizeof *h);
    snprintf(h->key, sizeof h->key, "%s", key);
    h->last_le = -INFINITY;
    return h;
}

static bool ends_with(const char *s, const char *suffix)
{
    size_t n = strlen(s), m = strlen(suffix);
    return n >= m && strcmp(s + n - m, suffix) == 0;
}

/* One sample line. */
static const char *prom_sample(prom_t *p, const char *line)
{
    char name[128], labels[512] = "", nole[512] = "", le[64] = "";
    char seen[16][64];
    int nseen = 0;
    size_t n = strcspn(line, "{ ");
    if (n >= sizeof name || !name_ok(line, n, false))
        return "bad metric name";
    snprintf(name, sizeof name, "%.*s", (int)n, line);
    const char *s = line + n;
    if (*s == '{') {
        s++;
        size_t ln = 0, nn = 0;
        while (*s != '}') {
            size_t k = strcspn(s, "=");
            if (!name_ok(s, k, true) || s[k] != '=' || s[k + 1] != '"')
                return "bad label name";
            char lname[64];
            snprintf(lname, sizeof lname, "%.*s", (int)k, s);
            for (int i = 0; i < nseen; i++)
                if (strcmp(seen[i], lname) == 0)
                    return "a label twice";
            if (nseen < 16)
                snprintf(seen[nseen++], sizeof seen[0], "%s", lname);
            const char *v = s + k + 2, *e = v;
            char value[256];
            size_t vn = 0;
            while (*e != '"') {
                if (*e == '\0' || *e == '\n')
                    return "unterminated label value";
                if (*e == '\\') {
                    e++;
                    if (*e != '\\' && *e != '"' && *e != 'n')
                        return "bad escape in a label value";
                }
                if (vn < sizeof value - 1)
                    value[vn++] = *e;
                e++;
            }
            value[vn] = '\0';
            size_t whole = (size_t)(e + 1 - s);
            if (ln + whole + 1 >= sizeof labels)
                return "labels too long";
            memcpy(labels + ln, s, whole);
            ln += whole;
            labels[ln++] = ',';
            labels[ln] = '\0';
            if (strcmp(lname, "le") == 0) {
                snprintf(le, sizeof le, "%s", value);
            } else {
                memcpy(nole + nn, s, whole);
                nn += whole;
                nole[nn++] = ',';
                nole[nn] = '\0';
            }
            s = e + 1;
            if (*s == ',')
                s++;
            else if (*s != '}')
                return "labels not separated by ','";
        }
        s++;
    }
    if (*s != ' ')
        return "no space before the value";
    s++;
    if (strchr(s, ' ') != NULL)
        return "a timestamp, or stray text after the value";
    double v;
    if (!float_ok(s, &v))
        return "bad value";

    /* Its family: the current one, by name and suffix. */
    if (p->cur < 0)
        return "a sample before any TYPE";
    const char *fam = p->fam[p->cur], *type = p->type[p->cur];
    if (type[0] == '\0')
        return "a sample of a family without TYPE";
    char series[640];
    snprintf(series, sizeof series, "%s{%s}", name, labels);
    for (int i = 0; i < p->nseries; i++)
        if (strcmp(p->series[i], series) == 0)
            return "a series twice";
    if (p->nseries == PROM_MAX_SERIES)
        return "too many series";
    snprintf(p->series[p->nseries++], sizeof p->series[0], "%s", series);
    p->sampled[p->cur] = true;
    p->samples++;

    if (strcmp(type, "histogram") != 0) {
        if (strcmp(name, fam) != 0)
            return "a sample outside its family's lines";
        if (le[0] != '\0')
            return "le on a non-histogram";
        if (strcmp(type, "counter") == 0 && (!ends_with(name, "_total") || !(v >= 0)))
            return "a counter not ending in _total, or negative";
        return NULL;
    }
    size_t fl = strlen(fam);
    const char *suffix = strncmp(name, fam, fl) == 0 ? name + fl : "";
    char key[512];
    snprintf(key, sizeof key, "%s{%s}", fam, nole);
    prom_hist_t *h = prom_hist(p, key);
    if (h == NULL)
        return "too many histograms";
    if (strcmp(suffix, "_bucket") == 0) {
        double lev;
        if (le[0] == '\0' || !float_ok(le, &lev) || isnan(lev))
            return "a bucket without a valid le";
        if (h->inf || lev <= h->last_le)
            return "bucket le not increasing";
        if (v < h->last_count)
            return "bucket counts decreasing";
        h->last_le = lev;
        h->last_count = v;
        h->inf = isinf(lev) && lev > 0;
    } else if (strcmp(suffix, "_sum") == 0 || strcmp(suffix, "_count") == 0) {
        if (le[0] != '\0')
            return "le on _sum or _count";
        if (!h->inf)
            return "_sum or _count before the +Inf bucket";
        if (suffix[1] == 's')
            h->has_sum = true;
        else {
            h->has_count = true;
            h->count = v;
        }
    } else {
        return "a sample outside its family's lines";
    }
    return NULL;
}

/* Reads the whole text. NULL when it keeps every rule; else the first rule
 * broken, with its line (in a static buffer). */
static const char *prom_read(prom_t *p, const char *text)
{
    static char why[1400];
    memset(p, 0, sizeof *p);
    p->cur = -1;
    p->series = calloc(PROM_MAX_SERIES, sizeof *p->series);
    CHECK(p->series != NULL);
    size_t len = strlen(text);
    const char *fail = NULL;
    if (len == 0 || text[len - 1] != '\n')
        fail = "the exposition does not end with a newline";
    int lineno = 0;
    for (const char *l = text; fail == NULL && *l != '\0';) {
        const char *nl = strchr(l, '\n');
        char line[1024];
        if ((size_t)(nl - l) >= sizeof line) {
            snprintf(why, sizeof why, "line %d: too long", lineno + 1);
            fail = why;
            break;
        }
        snprintf(line, sizeof line, "%.*s", (int)(nl - l), l);
        l = nl + 1;
        lineno++;
        const char *err = NULL;
        if (line[0] == '\0' || strchr(line, '\r') != NULL) {
            err = "an empty line, or a \\r";
        } else if (strncmp(line, "# HELP ", 7) == 0 || strncmp(line, "# TYPE ", 7) == 0) {
            bool help = line[2] == 'H';
            const char *name = line + 7;
            size_t n = strcspn(name, " ");
            char fam[96];
            snprintf(fam, sizeof fam, "%.*s", (int)n, name);
            int f = !name_ok(name, n, false) || name[n] != ' ' ? (err = "bad family name", -1) : prom_meta(p, fam, &err);
            if (f >= 0 && help) {
                if (p->help[f])
                    err = "HELP twice";
                p->help[f] = true;
            } else if (f >= 0) {
                const char *type = name + n + 1;
                if (p->type[f][0] != '\0')
                    err = "TYPE twice";
                else if (p->sampled[f])
                    err = "TYPE after a sample";
                else if (strcmp(type, "counter") != 0 && strcmp(type, "gauge") != 0 && strcmp(type, "histogram") != 0)
                    err = "unknown TYPE";
                else if (strcmp(type, "histogram") == 0 && !ends_with(fam, "_seconds"))
                    err = "a histogram not in _seconds";
                snprintf(p->type[f], sizeof p->type[f], "%s", type);
            }
        } else if (line[0] == '#') {
            err = NULL;   /* a comment */
        } else {
            err = prom_sample(p, line);
        }
        if (err != NULL) {
            snprintf(why, sizeof why, "line %d: %s: %s", lineno, err, line);
            fail = why;
        }
    }
    for (int i = 0; fail == NULL && i < p->nhist; i++) {
        const prom_hist_t *h = &p->hist[i];
        if (!h->inf || !h->has_sum || !h->has_count || h->count != h->last_count) {
            snprintf(why, sizeof why, "histogram %s: +Inf %d, _sum %d, _count %d, count %g, +Inf bucket %g", h->key,
                     h->inf, h->has_sum, h->has_count, h->count, h->last_count);
            fail = why;
        }
    }
    free(p->series);
    p->series = NULL;
    return fail;
}

static void prom_parse(prom_t *p, const char *text)
{
    const char *err = prom_read(p, text);
    if (err != NULL)
        SP_FAIL("metrics: %s", err);
}

/* The reader refuses what breaks a rule (so that its passing means something). */
static void prom_self_test(void)
{
    static const char *const bad[] = {
        "# TYPE a_total counter\na_total 1",                                    /* no final newline */
        "# TYPE a_total counter\n\na_total 1\n",                                /* empty line */
        "a_total 1\n",                                                          /* no TYPE */
        "# TYPE a_total counter\n# TYPE a_total counter\na_total 1\n",          /* TYPE twice */
        "# HELP a_total x\n# HELP a_total y\n# TYPE a_total counter\n",         /* HELP twice */
        "# TYPE a_total counter\na_total 1\n# TYPE b gauge\nb 1\n# HELP a_total x\n", /* apart */
        "# TYPE a counter\na 1\n",                                              /* counter not _total */
        "# TYPE a_total counter\na_total -1\n",                                 /* negative counter */
        "# TYPE a gauge\na{x=\"1\",x=\"2\"} 1\n",                              /* label twice */
        "# TYPE a gauge\na{x=\"\\t\"} 1\n",                                     /* bad escape */
        "# TYPE a gauge\na{__x=\"1\"} 1\n",                                     /* reserved label */
        "# TYPE a gauge\na{x=\"1\"} 1\na{x=\"1\"} 2\n",                         /* series twice */
        "# TYPE a gauge\na 1 1700000000\n",                                      /* timestamp */
        "# TYPE a gauge\na one\n",                                               /* value */
        "# TYPE a gauge\nb 1\n",                                                 /* outside its family */
        "# TYPE h_seconds histogram\nh_seconds_bucket{le=\"1\"} 2\nh_seconds_bucket{le=\"+Inf\"} 1\n"
        "h_seconds_sum 1\nh_seconds_count 1\n",                                  /* decreasing */
        "# TYPE h_seconds histogram\nh_seconds_bucket{le=\"1\"} 1\nh_seconds_bucket{le=\"+Inf\"} 1\n"
        "h_seconds_sum 1\nh_seconds_count 2\n",                                  /* +Inf != _count */
        "# TYPE h_seconds histogram\nh_seconds_bucket{le=\"1\"} 1\nh_seconds_sum 1\nh_seconds_count 1\n",
        "# TYPE h_seconds histogram\nh_seconds_bucket{le=\"2\"} 1\nh_seconds_bucket{le=\"1\"} 1\n"
        "h_seconds_bucket{le=\"+Inf\"} 1\nh_seconds_sum 1\nh_seconds_count 1\n", /* le not increasing */
        "# TYPE h histogram\nh_bucket{le=\"+Inf\"} 0\nh_sum 0\nh_count 0\n",      /* not _seconds */
    };
    prom_t *p = malloc(sizeof *p);
    CHECK(p != NULL);
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        if (prom_read(p, bad[i]) == NULL)
            SP_FAIL("the reader took bad exposition %zu:\n%s", i, bad[i]);
    const char *good = "# HELP a_total x\n# TYPE a_total counter\na_total{x=\"q\\\"\\n\\\\\"} 1\n"
                       "# TYPE h_seconds histogram\nh_seconds_bucket{op=\"a\",le=\"0.5\"} 1\n"
                       "h_seconds_bucket{op=\"a\",le=\"+Inf\"} 2\nh_seconds_sum{op=\"a\"} 0.7\n"
                       "h_seconds_count{op=\"a\"} 2\n# TYPE g gauge\ng NaN\n";
    const char *err = prom_read(p, good);
    if (err != NULL)
        SP_FAIL("the reader refused good exposition: %s", err);
    free(p);
}

/* The value of the series written exactly `series` ("name{labels}"); the test fails when absent. */
static double prom_value(const char *text, const char *series)
{
    size_t n = strlen(series);
    for (const char *l = text; l != NULL && *l != '\0'; l = strchr(l, '\n'), l = l ? l + 1 : NULL)
        if (strncmp(l, series, n) == 0 && l[n] == ' ')
            return strtod(l + n + 1, NULL);
    SP_FAIL("no series %s in the metrics", series);
}

/* ================================================================ HTTP */

static int http_port;
static char text[1 << 20], resp[(1 << 20) + 1024];
static char *job_label;   /* shared with the ranks: rank 0 works it out */

static int tcp_connect(void)
{
    return sp_test_tcp_connect(NULL, http_port);
}

/* Reads until the server closes (or timeout_ms); returns the bytes read. */
static size_t read_all(int fd, char *buf, size_t cap, int timeout_ms)
{
    size_t n = 0;
    uint64_t end = sp_test_now_ms() + (uint64_t)timeout_ms;
    for (;;) {
        int left = (int)(end - sp_test_now_ms());
        struct pollfd pfd = { .fd = fd, .events = POLLIN };
        if (left <= 0 || poll(&pfd, 1, left) != 1)
            SP_FAIL("the metrics endpoint did not close the connection within %d ms", timeout_ms);
        ssize_t r = read(fd, buf + n, cap - 1 - n);
        if (r <= 0)
            break;   /* closed (or reset) */
        n += (size_t)r;
        CHECK(n < cap - 1);
    }
    buf[n] = '\0';
    return n;
}

/* Sends `req` (len bytes) on a new connection and returns the whole answer in resp. */
static size_t http(const char *req, size_t len)
{
    int fd = tcp_connect();
    CHECK((size_t)write(fd, req, len) == len);
    size_t n = read_all(fd, resp, sizeof resp, 10000);
    close(fd);
    return n;
}

/* The body of a 200 answer, its headers checked. */
static const char *http_metrics(void)
{
    const char *req = "GET /metrics HTTP/1.1\r\nHost: localhost\r\nAccept: text/plain\r\n\r\n";
    size_t n = http(req, strlen(req));
    CHECK(strncmp(resp, "HTTP/1.0 200 OK\r\n", 17) == 0);
    CHECK_CONTAINS(resp, "\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n");
    CHECK_CONTAINS(resp, "\r\nConnection: close\r\n");
    const char *body = strstr(resp, "\r\n\r\n");
    CHECK(body != NULL);
    body += 4;
    const char *cl = strstr(resp, "Content-Length: ");
    CHECK(cl != NULL && cl < body);
    CHECK_EQ(strtoull(cl + 16, NULL, 10), n - (size_t)(body - resp));
    return body;
}

/* ================================================================ the job */

#define AR_COUNT 256

static int rank_main(spc_handle_t *h, spc_group_t world, int rank, int nranks, void *arg)
{
    (void)arg;
    float *x = spc_alloc(h, AR_COUNT * sizeof *x);
    CHECK(x != NULL);
    memset(x, 0, AR_COUNT * sizeof *x);
    for (int i = 0; i < 3; i++)
        CHECK_OK(h, spc_allreduce(h, world, x, x, AR_COUNT, SPC_F32, SPC_SUM, 10000));
    CHECK_ST(h, spc_allreduce(h, world, x, x, rank == 0 ? 1 : 2, SPC_F32, SPC_SUM, 10000), SPC_ERR_MISMATCH);
    if (rank == 0) {
        char job[SPC_JOB_ID_MAX + 8], series[512];
        CHECK_EQ(sp_test_run(text, sizeof text, "%s --json jobs", sp_test_spctl_bin()), 0);
        sp_test_json_str(text, "id", job, sizeof job);
        /* The label: the id with its token cut to 16 hex digits. */
        const char *colon = strrchr(job, ':');
        CHECK(colon != NULL && strlen(colon + 1) == 32);
        snprintf(job_label, SPC_JOB_ID_MAX, "%.*s", (int)(colon + 1 - job) + 16, job);

        CHECK_EQ(sp_test_run(text, sizeof text, "%s metrics", sp_test_spctl_bin()), 0);
        prom_t *p = malloc(sizeof *p);
        CHECK(p != NULL);
        prom_parse(p, text);
        free(p);
        CHECK(strstr(text, colon + 17) == NULL);   /* the rest of the token is nowhere */
        snprintf(series, sizeof series, "spd_group_ops_total{job_id=\"%s\",group=\"%u\",group_kind=\"world\","
                 "op=\"allreduce\"}", job_label, world);
        CHECK_EQ(prom_value(text, series), 4);
        snprintf(series, sizeof series, "spd_group_op_failures_total{job_id=\"%s\",group=\"%u\",group_kind=\"world\","
                 "op=\"allreduce\",status=\"SPC_ERR_MISMATCH\"}", job_label, world);
        CHECK_EQ(prom_value(text, series), 1);
        snprintf(series, sizeof series, "spd_group_bytes_total{job_id=\"%s\",group=\"%u\",group_kind=\"world\","
                 "op=\"allreduce\"}", job_label, world);
        CHECK_EQ(prom_value(text, series), 3ull * AR_COUNT * 4 * (uint64_t)nranks);
        snprintf(series, sizeof series, "spd_group_op_duration_seconds_count{job_id=\"%s\",group=\"%u\","
                 "group_kind=\"world\",op=\"allreduce\"}", job_label, world);
        CHECK_EQ(prom_value(text, series), 3);
        CHECK_EQ(prom_value(text, "spd_ops_total{op=\"allreduce\"}"), 4);
        CHECK_EQ(prom_value(text, "spd_clients"), nranks + 1);   /* and the job's creator */
        CHECK_EQ(prom_value(text, "spd_jobs"), 1);
        /* Sessions: the clients and this spctl at least (one that left may not be closed yet). */
        CHECK(prom_value(text, "spd_sessions") >= nranks + 2);
        CHECK_EQ(prom_value(text, "spd_sessions_max"), 256);
        /* The arenas: what spctl clients says each client's is. */
        static char clients[65536];
        CHECK_EQ(sp_test_run(clients, sizeof clients, "%s --json clients", sp_test_spctl_bin()), 0);
        double arenas = 0;
        for (const char *a = strstr(clients, "\"arena_bytes\":"); a != NULL; a = strstr(a + 1, "\"arena_bytes\":"))
            arenas += strtod(a + 14, NULL);
        CHECK(arenas > 0);
        CHECK_EQ(prom_value(text, "spd_arena_bytes"), arenas);
    }
    CHECK_OK(h, spc_barrier(h, world, 30000));   /* rank 1 waits for rank 0's look */
    return 0;
}

static int noop_rank(spc_handle_t *h, spc_group_t world, int rank, int nranks, void *arg)
{
    (void)rank;
    (void)nranks;
    (void)arg;
    CHECK_OK(h, spc_noop(h, 10000));
    CHECK_OK(h, spc_barrier(h, world, 10000));
    return 0;
}

/* text without the samples that asking changes: the sessions and process_*. */
static const char *steady(const char *in, char *out)
{
    size_t n = 0;
    for (const char *l = in; *l != '\0';) {
        const char *nl = strchr(l, '\n') + 1;
        if (strncmp(l, "spd_sessions ", 13) != 0 && strncmp(l, "spd_sessions_by_protocol{", 25) != 0 &&
            strncmp(l, "process_", 8) != 0) {
            memcpy(out + n, l, (size_t)(nl - l));
            n += (size_t)(nl - l);
        }
        l = nl;
    }
    out[n] = '\0';
    return out;
}

/* A hello that speaks no protocol spd knows: refused, and counted. */
static void refused_hello(void)
{
    int fd = sp_test_raw_connect(getenv("SPC_SOCKET"));
    Spd__Msg m = SPD__MSG__INIT;
    Spd__Hello h = SPD__HELLO__INIT;
    h.protocol = 99;
    m.seq = 1;
    m.body_case = SPD__MSG__BODY_HELLO;
    m.hello = &h;
    sp_test_raw_send_msg(fd, &m);
    Spd__Msg *r = sp_test_raw_recv(fd, 5000, NULL);
    CHECK(r != NULL && r->body_case == SPD__MSG__BODY_ERROR);
    sp_msg_free(r);
    close(fd);
}

/* The process_* families against what the kernel says of spd. */
static void check_process(const char *body, pid_t spd)
{
    double rss = prom_value(body, "process_resident_memory_bytes");
    double kib = (double)sp_test_proc_kib(spd, "VmRSS");
    CHECK(rss > 0.5 * kib * 1024 && rss < 2 * kib * 1024);
    CHECK(prom_value(body, "process_virtual_memory_bytes") >= rss);
    char path[64], out[256];
    snprintf(path, sizeof path, "/proc/%d/fd", (int)spd);
    CHECK_EQ(sp_test_run(out, sizeof out, "ls %s | wc -l", path), 0);
    double fds = prom_value(body, "process_open_fds"), seen = strtod(out, NULL);
    /* Connections come and go between the two looks: this scrape's own, at least. */
    CHECK(fds > 8 && fds >= seen - 4 && fds <= seen + 4);
    CHECK(prom_value(body, "process_max_fds") >= fds);
    CHECK(prom_value(body, "process_cpu_seconds_total") > 0);
    CHECK_EQ(prom_value(body, "process_start_time_seconds") > 1.7e9, 1);
}

int main(void)
{
    const char *args[] = { "--set", "metrics_listen=127.0.0.1:0", "--set", "metrics_per_group=1", NULL };
    const char *spctl = sp_test_spctl_bin();
    prom_self_test();
    sp_test_daemon_t d;
    sp_test_daemon_start(&d, args);

    char addr[128];
    CHECK_EQ(sp_test_run(text, sizeof text, "%s --json status", spctl), 0);
    sp_test_json_str(text, "metrics_listen", addr, sizeof addr);
    CHECK(strncmp(addr, "127.0.0.1:", 10) == 0);
    http_port = atoi(addr + 10);
    CHECK(http_port > 0);

    job_label = sp_test_shared(SPC_JOB_ID_MAX);
    sp_test_run_job(2, rank_main, NULL);
    CHECK(job_label[0] != '\0');

    /* Idle now: the endpoint and spctl say the same, byte for byte, but for
     * what the asking changes (spctl's session, the process's own figures). */
    const char *body;
    uint64_t settled = sp_test_now_ms() + 5000;   /* the ranks' and spctl's sessions close on their own time */
    while (prom_value(body = http_metrics(), "spd_sessions") != 0)
        CHECK(sp_test_now_ms() < settled);
    CHECK_EQ(sp_test_run(text, sizeof text, "%s metrics", spctl), 0);
    body = http_metrics();
    static char steady_http[1 << 20], steady_spctl[1 << 20];
    CHECK_STREQ(steady(body, steady_http), steady(text, steady_spctl));
    CHECK_EQ(prom_value(text, "spd_sessions"), 1);   /* its own */
    prom_t *p = malloc(sizeof *p);
    CHECK(p != NULL);
    prom_parse(p, body);
    CHECK(p->samples > 100);
    free(p);
    CHECK_EQ(prom_value(body, "spd_ops_total{op=\"barrier\"}"), 1);
    CHECK_EQ(prom_value(body, "spd_op_failures_total{op=\"allreduce\",status=\"SPC_ERR_MISMATCH\"}"), 1);
    CHECK_EQ(prom_value(body, "spd_op_duration_seconds_bucket{op=\"allreduce\",le=\"+Inf\"}"), 3);
    CHECK(strstr(body, "spd_group_") != NULL && strstr(body, job_label) == NULL);   /* the job's groups went with it */
    check_process(body, d.pid);
    /* Histograms show 12 bounds and +Inf. */
    int buckets = 0;
    for (const char *b = strstr(body, "spd_op_duration_seconds_bucket{op=\"allreduce\""); b != NULL;
         b = strstr(b + 1, "spd_op_duration_seconds_bucket{op=\"allreduce\""))
        buckets++;
    CHECK_EQ(buckets, 13);
    /* Refused attaches, by reason. */
    CHECK_EQ(prom_value(body, "spd_attach_refused_total{reason=\"protocol\"}"), 0);
    refused_hello();
    body = http_metrics();
    CHECK_EQ(prom_value(body, "spd_attach_refused_total{reason=\"protocol\"}"), 1);
    CHECK_EQ(prom_value(body, "spd_attach_refused_total{reason=\"limit\"}"), 0);
    CHECK_EQ(prom_value(body, "spd_attach_refused_total{reason=\"user\"}"), 0);
    CHECK_EQ(prom_value(body, "spd_peers{state=\"up\"}"), 0);
    CHECK_EQ(prom_value(body, "spd_peer_rtt_seconds_count"), 0);

    /* What is not GET /metrics is refused, each with its status, and closed. */
    static const struct { const char *req, *status; } bad[] = {
        { "\x01\x02garbage\r\n\r\n", "HTTP/1.0 400 " },
        { "GET /metrics\r\n\r\n", "HTTP/1.0 400 " },
        { "GET  /metrics HTTP/1.0\r\n\r\n", "HTTP/1.0 400 " },
        { "GET /metrics HTTP/2.0\r\n\r\n", "HTTP/1.0 400 " },
        { "POST /metrics HTTP/1.0\r\nContent-Length: 0\r\n\r\n", "HTTP/1.0 405 " },
        { "GET /other HTTP/1.0\r\n\r\n", "HTTP/1.0 404 " },
        { "GET /metricsx HTTP/1.0\n\n", "HTTP/1.0 404 " },
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        http(bad[i].req, strlen(bad[i].req));
        if (strncmp(resp, bad[i].status, strlen(bad[i].status)) != 0)
            SP_FAIL("request %zu: \"%.40s\" instead of \"%s\"", i, resp, bad[i].status);
    }
    CHECK_CONTAINS(resp, "\r\nContent-Length: 14\r\n");   /* "404 Not Found\n" */
    /* A head larger than the limit, sent without an end: 431, then closed. */
    static char big[16384];
    memset(big, 'A', sizeof big);
    memcpy(big, "GET /metrics HTTP/1.0\r\nX-Pad: ", 30);
    http(big, sizeof big);
    CHECK(strncmp(resp, "HTTP/1.0 431 ", 13) == 0);
    /* The answer also comes when the client keeps sending after it. */

    /* A client that sends nothing is closed by the server after its timeout;
     * meanwhile others are answered. */
    int idle = tcp_connect();
    uint64_t t0 = sp_test_now_ms();
    http_metrics();
    CHECK_EQ(read_all(idle, resp, sizeof resp, 15000), 0);
    CHECK(sp_test_now_ms() - t0 >= 4000);
    close(idle);

    /* Connections beyond the limit (16) close the oldest, answered nothing;
     * the others wait for their request (their timeout is 5 s). Connections of
     * the requests above that the server has not seen go yet may hold a place,
     * so this counts at least, not exactly. */
    enum { HELD = 20 };
    struct pollfd held[HELD];
    for (int i = 0; i < HELD; i++)
        held[i] = (struct pollfd){ .fd = tcp_connect(), .events = POLLIN };
    int closed = 0;
    for (uint64_t end = sp_test_now_ms() + 3000; closed < HELD - 16 && sp_test_now_ms() < end;) {
        if (poll(held, HELD, 100) <= 0)
            continue;
        for (int i = 0; i < HELD; i++) {
            if (held[i].fd >= 0 && held[i].revents != 0) {
                CHECK(read(held[i].fd, resp, 1) <= 0);   /* closed, nothing said */
                close(held[i].fd);
                held[i].fd = -1;
                closed++;
            }
        }
    }
    CHECK(closed >= HELD - 16);
    CHECK(held[HELD - 1].fd >= 0);   /* the newest stays */
    /* Sixteen idle connections do not lock a scrape out: it is answered at once. */
    const char *scrape = "GET /metrics HTTP/1.0\r\n\r\n";
    CHECK_EQ(http(scrape, strlen(scrape)) > 0, 1);
    CHECK(strncmp(resp, "HTTP/1.0 200 OK\r\n", 17) == 0);
    for (int i = 0; i < HELD; i++)
        if (held[i].fd >= 0)
            close(held[i].fd);

    /* spd served on through all that: its control socket, and a new job's ops. */
    CHECK_EQ(sp_test_run(text, sizeof text, "%s status", spctl), 0);
    CHECK_CONTAINS(text, "state             running");
    sp_test_run_job(2, noop_rank, NULL);
    body = http_metrics();
    CHECK_EQ(prom_value(body, "spd_ops_total{op=\"noop\"}"), 2);
    CHECK_EQ(prom_value(body, "spd_ops_total{op=\"barrier\"}"), 2);
    CHECK_EQ(sp_test_daemon_stop(&d), 0);
    sp_test_daemon_cleanup(&d);

    /* Off by default. */
    sp_test_daemon_t d2;
    sp_test_daemon_start(&d2, NULL);
    CHECK_EQ(sp_test_run(text, sizeof text, "%s --json status", spctl), 0);
    CHECK_CONTAINS(text, "\"metrics_listen\":\"\"");
    CHECK_EQ(sp_test_run(text, sizeof text, "%s config get metrics_listen", spctl), 0);
    CHECK_CONTAINS(text, "metrics_listen \"\"\n  source: default");
    CHECK_EQ(sp_test_daemon_stop(&d2), 0);

    /* Not loopback: refused, unless allowed; a configuration error (EX_CONFIG). */
    CHECK_EQ(sp_test_run(text, sizeof text, "%s --set socket=%s/other/spd.sock --set metrics_listen=0.0.0.0:0 2>&1",
                         sp_test_spd_bin(), d2.dir), 78);
    CHECK_CONTAINS(text, "is not a loopback address");
    CHECK_CONTAINS(text, "metrics_allow_remote");
    CHECK_EQ(sp_test_run(text, sizeof text, "%s --set socket=%s/other/spd.sock --set metrics_listen=localhost:9 2>&1",
                         sp_test_spd_bin(), d2.dir), 78);
    CHECK_CONTAINS(text, "give a numeric address and a port");
    sp_test_daemon_cleanup(&d2);
    printf("metrics: ok\n");
    return 0;
}
