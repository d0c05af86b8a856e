/*
 * sp_futex.h — futex wait/wake on words in shared mappings (both sides use these).
 *
 * The words live in memfd segments mapped by several processes, so these are the
 * shared (non-private) futex operations.
 */
#ifndef SP_FUTEX_H
#define SP_FUTEX_H

#include <errno.h>
#include <linux/futex.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

/*
 * Sleeps while *word == expected, at most timeout_ns (relative). Returns 0 when
 * woken, or -EAGAIN (the word had already changed), -ETIMEDOUT or -EINTR; callers
 * re-check their condition whatever the result.
 */
static inline int sp_futex_wait(_Atomic uint32_t *word, uint32_t expected, int64_t timeout_ns)
{
    struct timespec ts = {
        .tv_sec = (time_t)(timeout_ns / 1000000000),
        .tv_nsec = (long)(timeout_ns % 1000000000),
    };
    long rc = syscall(SYS_futex, (uint32_t *)word, FUTEX_WAIT, expected, &ts, NULL, 0);
    return rc == 0 ? 0 : -errno;
}

/* Wakes up to n sleepers on word. */
static inline void sp_futex_wake(_Atomic uint32_t *word, int n)
{
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAKE, n, NULL, NULL, 0);
}

/* Bumps the word, so a sleeper that read the old value does not go to sleep, and
 * wakes the sleepers. */
static inline void sp_futex_bump_wake(_Atomic uint32_t *word)
{
    atomic_fetch_add_explicit(word, 1, memory_order_release);
    sp_futex_wake(word, 0x7fffffff);
}

#endif /* SP_FUTEX_H */
