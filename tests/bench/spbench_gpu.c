/*
 * spbench-gpu — the fused all-to-all kernel on one GPU, beside the copy bound
 * measured in the same run.
 *
 *   spbench-gpu [--seq S[,S...]] [--ranks P[,P...]] [--heads H] [--dim D] [--iters K]
 *
 * A Ulysses all-to-all of one bf16 BSHD tensor [1, S/P, H, D] on P ranks
 * (default S = 16384 and 131072, P = 2, 4, 8, H = 32, D = 128), the P ranks
 * simulated as P pairs of device buffers on one GPU. Each point times:
 *   - fused: sp_kern_a2a_cuda once per rank, each launch writing that rank's whole
 *     output from the P inputs: all P outputs, P launches;
 *   - copy bound: cudaMemcpyAsync device to device of the same bytes (each rank's
 *     output from a buffer of its size): the P * out bytes the op must write, at
 *     the copy engine's (or the driver's copy kernel's) speed. bound = fused_us /
 *     copy_us; GB/s counts bytes read plus bytes written (1e9 bytes/s).
 * seq->head and head->seq both. CUDA events around the P launches (or copies);
 * medians over K iterations (default 50) after 5 warm-up ones.
 */
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sp_kern_cuda.h"

#define MAXP 8
#define MAXLIST 8

#define CUDA_OR_DIE(call)                                                                   \
    do {                                                                                    \
        cudaError_t e_ = (call);                                                            \
        if (e_ != cudaSuccess) {                                                            \
            fprintf(stderr, "spbench-gpu: %s: %s\n", #call, cudaGetErrorString(e_));        \
            exit(1);                                                                        \
        }                                                                                   \
    } while (0)

static int parse_list(const char *s, unsigned *out)
{
    int n = 0;
    for (char *end; *s && n < MAXLIST; s = *end ? end + 1 : end) {
        out[n++] = (unsigned)strtoul(s, &end, 10);
        if (end == s)
            break;
    }
    return n;
}

static int cmp_float(const void *a, const void *b)
{
    float x = *(const float *)a, y = *(const float *)b;
    return x < y ? -1 : x > y;
}

static float median(float *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, cmp_float);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

typedef struct point {
    unsigned P, S, H, D, dir;
    void    *in[MAXP], *out[MAXP], *copy_src[MAXP];
    uint64_t in_bytes, out_bytes;
    sp_kern_a2a_desc_t d;
} point_t;

/* One iteration of either side: all P ranks' outputs. */
static void run_once(point_t *p, int fused, cudaStream_t st)
{
    for (unsigned r = 0; r < p->P; r++) {
        if (fused) {
            int rc = sp_kern_a2a_cuda(p->out[r], (const void *const *)p->in, &p->d, r, st);
            if (rc != 0) {
                fprintf(stderr, "spbench-gpu: sp_kern_a2a_cuda returned %d\n", rc);
                exit(1);
            }
        } else {
            CUDA_OR_DIE(cudaMemcpyAsync(p->out[r], p->copy_src[r], p->out_bytes, cudaMemcpyDeviceToDevice, st));
        }
    }
}

static float time_us(point_t *p, int fused, int iters, cudaStream_t st, cudaEvent_t e0, cudaEvent_t e1)
{
    float *t = malloc(sizeof *t * (size_t)iters);
    for (int i = 0; i < 5; i++)
        run_once(p, fused, st);
    for (int i = 0; i < iters; i++) {
        CUDA_OR_DIE(cudaEventRecord(e0, st));
        run_once(p, fused, st);
        CUDA_OR_DIE(cudaEventRecord(e1, st));
        CUDA_OR_DIE(cudaEventSynchronize(e1));
        float ms;
        CUDA_OR_DIE(cudaEventElapsedTime(&ms, e0, e1));
        t[i] = ms * 1000.0f;
    }
    float m = median(t, iters);
    free(t);
    return m;
}

int main(int argc, char **argv)
{
    unsigned seqs[MAXLIST] = { 16384, 131072 }, ranks[MAXLIST] = { 2, 4, 8 }, H = 32, D = 128;
    int nseq = 2, nranks = 3, iters = 50;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--seq") && i + 1 < argc)
            nseq = parse_list(argv[++i], seqs);
        else if (!strcmp(argv[i], "--ranks") && i + 1 < argc)
            nranks = parse_list(argv[++i], ranks);
        else if (!strcmp(argv[i], "--heads") && i + 1 < argc)
            H = (unsigned)atoi(argv[++i]);
        else if (!strcmp(argv[i], "--dim") && i + 1 < argc)
            D = (unsigned)atoi(argv[++i]);
        else if (!strcmp(argv[i], "--iters") && i + 1 < argc)
            iters = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: spbench-gpu [--seq S,...] [--ranks P,...] [--heads H] [--dim D] [--iters K]\n");
            return 2;
        }
    }
    int ndev = 0;
    if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
        fprintf(stderr, "spbench-gpu: no usable CUDA device\n");
        return 77;
    }
    struct cudaDeviceProp prop;
    CUDA_OR_DIE(cudaGetDeviceProperties(&prop, 0));
    printf("# %s; bf16 BSHD [1, S/P, %u, %u]; medians of %d iterations; GB/s = (read + written) / time\n", prop.name,
           H, D, iters);
    printf("%-9s %2s %7s %10s %10s %10s %8s %8s %6s\n", "direction", "P", "S", "out/rank", "fused_us", "copy_us",
           "fused_GB/s", "copy_GB/s", "bound");
    cudaStream_t st;
    cudaEvent_t e0, e1;
    CUDA_OR_DIE(cudaStreamCreate(&st));
    CUDA_OR_DIE(cudaEventCreate(&e0));
    CUDA_OR_DIE(cudaEventCreate(&e1));
    for (int si = 0; si < nseq; si++)
        for (int pi = 0; pi < nranks; pi++)
            for (unsigned dir = 0; dir < 2; dir++) {
                point_t p = { .P = ranks[pi], .S = seqs[si], .H = H, .D = D, .dir = dir };
                if (p.P == 0 || p.P > MAXP || p.S % p.P != 0 || H % p.P != 0) {
                    fprintf(stderr, "spbench-gpu: P = %u does not divide S = %u and H = %u (or is over %d)\n", p.P,
                            p.S, H, MAXP);
                    return 2;
                }
                p.d = (sp_kern_a2a_desc_t){ dir, SP_KERN_BSHD, 1, p.S, H, D, SP_KERN_HEADS_Q, 0, p.P, SP_KERN_BF16, 0 };
                sp_kern_a2a_geom_t g;
                if (sp_kern_a2a_geom(&g, &p.d, 0) != 0) {
                    fprintf(stderr, "spbench-gpu: invalid descriptor\n");
                    return 2;
                }
                p.in_bytes = sp_kern_a2a_src_bytes(&g);
                p.out_bytes = sp_kern_a2a_out_bytes(&g);
                for (unsigned r = 0; r < p.P; r++) {
                    CUDA_OR_DIE(cudaMalloc(&p.in[r], p.in_bytes));
                    CUDA_OR_DIE(cudaMalloc(&p.out[r], p.out_bytes));
                    CUDA_OR_DIE(cudaMalloc(&p.copy_src[r], p.out_bytes));
                    CUDA_OR_DIE(cudaMemset(p.in[r], 0x3c + (int)r, p.in_bytes));
                    CUDA_OR_DIE(cudaMemset(p.copy_src[r], 0x3c, p.out_bytes));
                }
                /* Each side twice, alternating, the faster kept: clocks and caches warm alike for both. */
                float fused = time_us(&p, 1, iters, st, e0, e1), copy = time_us(&p, 0, iters, st, e0, e1);
                float fused2 = time_us(&p, 1, iters, st, e0, e1), copy2 = time_us(&p, 0, iters, st, e0, e1);
                fused = fused2 < fused ? fused2 : fused;
                copy = copy2 < copy ? copy2 : copy;
                double moved = 2.0 * p.P * (double)p.out_bytes;
                printf("%-9s %2u %7u %9.2fM %10.1f %10.1f %8.0f %8.0f %6.2f\n", dir ? "head->seq" : "seq->head", p.P,
                       p.S, p.out_bytes / 1048576.0, fused, copy, moved / fused / 1e3, moved / copy / 1e3,
                       fused / copy);
                fflush(stdout);
                for (unsigned r = 0; r < p.P; r++) {
                    cudaFree(p.in[r]);
                    cudaFree(p.out[r]);
                    cudaFree(p.copy_src[r]);
                }
            }
    return 0;
}
