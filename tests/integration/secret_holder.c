/*
 * secret_holder — the program test_exec_creds execs in place of a client that
 * attached, installed setuid root where the filesystem allows it. It plays a
 * privileged program with a secret in memory at an address the old client had
 * registered:
 *
 *   secret_holder READY_FD GO_FD ADDR SECRET
 *
 * maps a page at ADDR, fills it with SECRET, writes its effective uid (an int)
 * to READY_FD, waits for a byte on GO_FD, and exits 0 when the page still holds
 * SECRET, 3 when something wrote into it, 2 on a bad start. Only libc: a setuid
 * program loads nothing from the build tree.
 */
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define PAGE 4096

int main(int argc, char **argv)
{
    if (argc != 5)
        return 2;
    int ready = atoi(argv[1]), go = atoi(argv[2]);
    void *want = (void *)strtoull(argv[3], NULL, 16);
    const char *secret = argv[4];
    size_t n = strlen(secret);
    if (n == 0 || n > PAGE)
        return 2;

    char *page = mmap(want, PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0);
    if (page != want)
        return 2;
    for (size_t i = 0; i + n <= PAGE; i += n)
        memcpy(page + i, secret, n);

    int euid = (int)geteuid();
    char byte;
    if (write(ready, &euid, sizeof euid) != sizeof euid || read(go, &byte, 1) != 1)
        return 2;
    for (size_t i = 0; i + n <= PAGE; i += n)
        if (memcmp(page + i, secret, n) != 0)
            return 3;
    return 0;
}
