/*
 * spbench-memcopy — the two ways spd reaches a client's registered host memory
 * (daemon/core/mem.c), side by side: process_vm_readv/writev, and pread/pwrite on
 * /proc/<pid>/mem, which spd uses where it holds CAP_SYS_PTRACE.
 *
 *   spbench-memcopy [SIZE_MIB [REPS]]     (default 64 MiB, 9 repetitions)
 *
 * A child maps SIZE_MIB of touched memory and waits; this process copies all
 * of it in and out, each way REPS times, and prints the median time and rate
 * of each (and the fastest). Both ways need ptrace access to the child, which
 * its parent has.
 */
#include <fcntl.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define MAX_REPS 101

typedef ssize_t (*copy_fn)(pid_t pid, int fd, char *local, uint64_t remote, size_t len);

static ssize_t vm_read(pid_t pid, int fd, char *local, uint64_t remote, size_t len)
{
    struct iovec l = { local, len }, r = { (void *)(uintptr_t)remote, len };
    (void)fd;
    return process_vm_readv(pid, &l, 1, &r, 1, 0);
}

static ssize_t vm_write(pid_t pid, int fd, char *local, uint64_t remote, size_t len)
{
    struct iovec l = { local, len }, r = { (void *)(uintptr_t)remote, len };
    (void)fd;
    return process_vm_writev(pid, &l, 1, &r, 1, 0);
}

static ssize_t mem_read(pid_t pid, int fd, char *local, uint64_t remote, size_t len)
{
    (void)pid;
    return pread(fd, local, len, (off_t)remote);
}

static ssize_t mem_write(pid_t pid, int fd, char *local, uint64_t remote, size_t len)
{
    (void)pid;
    return pwrite(fd, local, len, (off_t)remote);
}

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static int by_value(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Times one whole copy, looping over short transfers as spd does. */
static double time_copy(copy_fn fn, pid_t pid, int fd, char *local, uint64_t remote, size_t len)
{
    double t0 = now_s();
    for (size_t done = 0; done < len;) {
        ssize_t n = fn(pid, fd, local + done, remote + done, len - done);
        if (n <= 0) {
            perror("copy");
            exit(1);
        }
        done += (size_t)n;
    }
    return now_s() - t0;
}

int main(int argc, char **argv)
{
    size_t mib = argc > 1 ? strtoul(argv[1], NULL, 10) : 64;
    int reps = argc > 2 ? atoi(argv[2]) : 9;
    if (mib == 0 || reps < 1 || reps > MAX_REPS) {
        fprintf(stderr, "usage: spbench-memcopy [SIZE_MIB [REPS <= %d]]\n", MAX_REPS);
        return 2;
    }
    const size_t len = mib << 20;
    char *local = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    int addr_pipe[2];
    if (local == MAP_FAILED || pipe(addr_pipe) != 0) {
        perror("setup");
        return 1;
    }
    memset(local, 1, len);

    pid_t child = fork();
    if (child == 0) {
        char *mine = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        memset(mine, 2, len);
        uint64_t at = (uint64_t)(uintptr_t)mine;
        if (write(addr_pipe[1], &at, sizeof at) != sizeof at)
            _exit(1);
        pause();
        _exit(0);
    }
    uint64_t remote;
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/mem", (int)child);
    int fd = read(addr_pipe[0], &remote, sizeof remote) == sizeof remote ? open(path, O_RDWR | O_CLOEXEC) : -1;
    if (fd < 0) {
        perror(path);
        kill(child, SIGKILL);
        return 1;
    }

    static const struct { const char *name; copy_fn fn; } ways[] = {
        { "process_vm_readv", vm_read }, { "process_vm_writev", vm_write },
        { "pread /proc/pid/mem", mem_read }, { "pwrite /proc/pid/mem", mem_write },
    };
    double t[4][MAX_REPS];
    for (int r = 0; r < reps; r++)   /* interleaved, so drift hits every way alike */
        for (int w = 0; w < 4; w++)
            t[w][r] = time_copy(ways[w].fn, child, fd, local, remote, len);
    printf("%-22s %8s %12s %10s %12s\n", "way", "MiB", "median ms", "GB/s", "fastest ms");
    for (int w = 0; w < 4; w++) {
        qsort(t[w], (size_t)reps, sizeof t[w][0], by_value);
        double med = t[w][reps / 2];
        printf("%-22s %8zu %12.2f %10.2f %12.2f\n", ways[w].name, mib, med * 1e3, (double)len / med / 1e9,
               t[w][0] * 1e3);
    }
    close(fd);
    kill(child, SIGKILL);
    waitpid(child, NULL, 0);
    return 0;
}
