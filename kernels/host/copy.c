/* copy.c — host copies that bypass the cache. See sp_kern.h. */
#include <string.h>

#include "sp_kern.h"

#if defined(__x86_64__)
#include <emmintrin.h>

void sp_kern_copy_stream(void *dst, const void *src, size_t n)
{
    uint8_t *d = dst;
    const uint8_t *s = src;
    size_t head = (size_t)(-(uintptr_t)d & 15);   /* streaming stores need 16-byte alignment */
    if (head > n)
        head = n;
    memcpy(d, s, head);
    d += head;
    s += head;
    n -= head;
    for (; n >= 64; n -= 64, d += 64, s += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)s);
        __m128i b = _mm_loadu_si128((const __m128i *)(s + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(s + 48));
        _mm_stream_si128((__m128i *)d, a);
        _mm_stream_si128((__m128i *)(d + 16), b);
        _mm_stream_si128((__m128i *)(d + 32), c);
        _mm_stream_si128((__m128i *)(d + 48), e);
    }
    memcpy(d, s, n);
}

void sp_kern_copy_fence(void)
{
    _mm_sfence();
}

#else

void sp_kern_copy_stream(void *dst, const void *src, size_t n)
{
    memcpy(dst, src, n);
}

void sp_kern_copy_fence(void)
{
}

#endif
