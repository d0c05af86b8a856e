/*
 * fuzz.h — what the fuzz harnesses share: the entry point libFuzzer calls (and
 * tests/fuzz/replay.c, where there is no libFuzzer), and a check that stops
 * the run with its reason, so that a broken property is a crash the fuzzer
 * keeps as an artifact.
 */
#ifndef SP_FUZZ_H
#define SP_FUZZ_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define FUZZ_CHECK(cond, ...)                                                           \
    do {                                                                                \
        if (!(cond)) {                                                                  \
            fprintf(stderr, "FUZZ CHECK FAILED %s:%d: %s: ", __FILE__, __LINE__, #cond); \
            fprintf(stderr, __VA_ARGS__);                                               \
            fputc('\n', stderr);                                                        \
            abort();                                                                    \
        }                                                                               \
    } while (0)

#endif /* SP_FUZZ_H */
