/*
 * replay.c — a main() for a fuzz harness built without libFuzzer: runs it once
 * over each input named on the command line (a file, or every file of a
 * directory, in name order). ctest replays tests/fuzz/corpus this way in every
 * configuration, so the seeds and the inputs that once broke spd keep passing
 * under gcc and the sanitizers too. A harness that finds a broken property
 * aborts, and the run fails naming the input.
 *
 *   replay PATH...     exit 0: every input ran; 1: an input could not be read,
 *                      or there were none
 */
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "fuzz.h"

static int run_file(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (f == NULL) {
        fprintf(stderr, "replay: %s: %s\n", path, strerror(errno));
        return -1;
    }
    size_t cap = 4096, len = 0;
    uint8_t *buf = malloc(cap);
    for (size_t n; buf != NULL && (n = fread(buf + len, 1, cap - len, f)) > 0;) {
        len += n;
        if (len == cap) {
            uint8_t *bigger = realloc(buf, cap * 2);
            if (bigger == NULL) {
                free(buf);
                buf = NULL;
                break;
            }
            buf = bigger;
            cap *= 2;
        }
    }
    fclose(f);
    if (buf == NULL) {
        fprintf(stderr, "replay: %s: out of memory\n", path);
        return -1;
    }
    /* Tell which input it was before running it: a failure aborts. */
    fprintf(stderr, "replay: %s (%zu bytes)\n", path, len);
    LLVMFuzzerTestOneInput(buf, len);
    free(buf);
    return 0;
}

static int name_order(const struct dirent **a, const struct dirent **b)
{
    return strcmp((*a)->d_name, (*b)->d_name);
}

int main(int argc, char **argv)
{
    unsigned ran = 0;

    for (int i = 1; i < argc; i++) {
        struct stat st;
        if (stat(argv[i], &st) != 0) {
            fprintf(stderr, "replay: %s: %s\n", argv[i], strerror(errno));
            return 1;
        }
        if (!S_ISDIR(st.st_mode)) {
            if (run_file(argv[i]) != 0)
                return 1;
            ran++;
            continue;
        }
        struct dirent **names;
        int n = scandir(argv[i], &names, NULL, name_order);
        if (n < 0) {
            fprintf(stderr, "replay: %s: %s\n", argv[i], strerror(errno));
            return 1;
        }
        int rc = 0;
        for (int k = 0; k < n; k++) {
            char path[4096];
            snprintf(path, sizeof path, "%s/%s", argv[i], names[k]->d_name);
            if (rc == 0 && stat(path, &st) == 0 && S_ISREG(st.st_mode)) {
                rc = run_file(path);
                ran++;
            }
            free(names[k]);
        }
        free(names);
        if (rc != 0)
            return 1;
    }
    if (ran == 0) {
        fprintf(stderr, "replay: no inputs\n");
        return 1;
    }
    printf("replayed %u inputs\n", ran);
    return 0;
}
