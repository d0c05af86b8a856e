/*
 * fuzz_http.c — fuzz harness: the bytes a client sends the metrics endpoint
 * (metrics_listen, daemon/obs/metrics_http.c).
 *
 * The input is what arrives on one connection; the endpoint reads at most
 * SP_METRICS_HTTP_HEAD_MAX bytes of it. The harness judges them with
 * sp_metrics_http_judge, as conn_on_read does:
 *   1. at once, from a heap copy of exactly the input (ASan: nothing is read
 *      past it, and nothing past the head's limit changes the answer);
 *   2. one byte per read, the bytes not yet read poisoned (ASan: nothing is
 *      read past what arrived): the answer comes with the byte that ends the
 *      head, or with the one that fills it (431), never before;
 *   3. in reads of sizes drawn from the input, as TCP may cut it: the same
 *      answer, at the first read that holds that byte;
 * and checks the answer against the rules as metrics_http.c states them,
 * read again here: 200 exactly for "GET /metrics[?query] HTTP/1.0|1.1" and
 * for "GET /healthz[?query] HTTP/1.0|1.1", the route the second (here HEALTHZ), 400
 * for any other request line that is not "method SP target SP version" in
 * printable ASCII with such a version, 405 for another method, 404 for another
 * path, 431 for a full head without an end, and no answer while the head may
 * still end.
 * Built with libFuzzer (SP_FUZZ=ON) it is fuzzed; otherwise tests/fuzz/replay.c
 * gives it a main() and ctest runs it over tests/fuzz/corpus/http.
 */
#include <sanitizer/asan_interface.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "obs/metrics.h"

#include "fuzz.h"

#define HEAD_MAX SP_METRICS_HTTP_HEAD_MAX
/* 200 with the route /healthz, told apart from /metrics's 200 in one number. */
#define HEALTHZ 2001

/* The judge's answer in the harness's numbers. */
static int judge(const char *h, size_t len, size_t scanned)
{
    sp_metrics_route_t route = SP_METRICS_ROUTE_METRICS;
    int status = sp_metrics_http_judge(h, len, scanned, &route);
    return status == 200 && route == SP_METRICS_ROUTE_HEALTHZ ? HEALTHZ : status;
}

/* One past the last byte of the head (its first empty line), or 0 when b[0, n)
 * holds no end yet. Found by where an end finishes, the earliest first. */
static size_t head_end(const uint8_t *b, size_t n)
{
    for (size_t e = 2; e <= n; e++) {
        if (b[e - 2] == '\n' && b[e - 1] == '\n')
            return e;
        if (e >= 4 && memcmp(b + e - 4, "\r\n\r\n", 4) == 0)
            return e;
    }
    return 0;
}

static bool printable(const uint8_t *s, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (s[i] < 0x20 || s[i] > 0x7e)
            return false;
    return true;
}

static bool equals(const uint8_t *s, size_t n, const char *word)
{
    return n == strlen(word) && memcmp(s, word, n) == 0;
}

/* The status the rules give request line s[0, n): split at its spaces into
 * exactly three words, none empty. */
static int expected_status(const uint8_t *s, size_t n)
{
    size_t start[3], len[3], words = 0, at = 0;

    if (!printable(s, n))
        return 400;
    for (;;) {
        const uint8_t *space = memchr(s + at, ' ', n - at);
        size_t stop = space != NULL ? (size_t)(space - s) : n;
        if (words == 3 || stop == at)
            return 400;   /* a fourth word, or an empty one */
        start[words] = at;
        len[words++] = stop - at;
        if (space == NULL)
            break;
        at = stop + 1;
    }
    if (words != 3)
        return 400;
    const uint8_t *version = s + start[2];
    if (!equals(version, len[2], "HTTP/1.0") && !equals(version, len[2], "HTTP/1.1"))
        return 400;
    if (!equals(s + start[0], len[0], "GET"))
        return 405;
    const uint8_t *target = s + start[1];
    const uint8_t *query = memchr(target, '?', len[1]);
    size_t path = query != NULL ? (size_t)(query - target) : len[1];
    if (equals(target, path, "/metrics"))
        return 200;
    return equals(target, path, "/healthz") ? HEALTHZ : 404;
}

/* What the endpoint must answer to in[0, n), and at which byte: *at_p is the
 * byte count that completes the head (or fills it); 0 with no answer. */
static int expected(const uint8_t *in, size_t n, size_t *at_p)
{
    size_t end = head_end(in, n);
    if (end == 0) {
        *at_p = n == HEAD_MAX ? HEAD_MAX : 0;
        return n == HEAD_MAX ? 431 : 0;
    }
    size_t line = 0;
    while (in[line] != '\r' && in[line] != '\n')
        line++;
    *at_p = end;
    return expected_status(in, line);
}

/* The head as the connection holds it: bytes past those read are poisoned. */
static char *head;

static int judge_read(size_t len, size_t scanned)
{
    ASAN_POISON_MEMORY_REGION(head + len, HEAD_MAX - len);
    int status = judge(head, len, scanned);
    ASAN_UNPOISON_MEMORY_REGION(head, HEAD_MAX);
    return status;
}

static uint64_t next_random(uint64_t *x)
{
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    return *x;
}

/* Step 3: reads of 1 to 700 bytes; the answer is checked where it comes. */
static void judge_in_pieces(const uint8_t *in, size_t n, int want, size_t at)
{
    uint64_t x = 0x9e3779b97f4a7c15u ^ n;
    for (size_t i = 0; i < n; i++)
        x = (x ^ in[i]) * 0x100000001b3u;
    x |= 1;
    size_t len = 0;
    while (len < n) {
        size_t piece = 1 + next_random(&x) % 700;
        size_t scanned = len;
        len = piece < n - len ? len + piece : n;
        int status = judge_read(len, scanned);
        if (status != 0) {
            FUZZ_CHECK(status == want && len >= at && scanned < at,
                       "in pieces: %d after %zu bytes (the read before: %zu); wanted %d at byte %zu", status, len,
                       scanned, want, at);
            return;
        }
    }
    FUZZ_CHECK(want == 0, "in pieces: no answer to %zu bytes; wanted %d at byte %zu", n, want, at);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (head == NULL && (head = malloc(HEAD_MAX)) == NULL)
        abort();
    size_t n = size < HEAD_MAX ? size : HEAD_MAX;
    size_t at;
    int want = expected(data, n, &at);

    /* 1. At once, the whole input (more than the limit too). */
    uint8_t *copy = malloc(size ? size : 1);
    FUZZ_CHECK(copy != NULL, "out of memory");
    memcpy(copy, data, size);
    int whole = judge((const char *)copy, size, 0);
    free(copy);
    FUZZ_CHECK(whole == want, "at once: %d; the rules say %d", whole, want);
    FUZZ_CHECK(want == 0 || want == 200 || want == HEALTHZ || want == 400 || want == 404 || want == 405 || want == 431, "status %d",
               want);

    /* 2. A byte per read. */
    memcpy(head, data, n);
    int answer = 0;
    size_t len = 0;
    while (answer == 0 && len < n) {
        len++;
        answer = judge_read(len, len - 1);
    }
    FUZZ_CHECK(answer == want && (want == 0 || len == at), "byte by byte: %d at byte %zu; wanted %d at byte %zu",
               answer, len, want, at);

    /* 3. In pieces. */
    judge_in_pieces(data, n, want, at);
    return 0;
}
