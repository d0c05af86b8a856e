/*
 * sp_text.h — building a message in a fixed buffer, piece by piece, for the
 * explanations placement and topology write (sp_place.c, sp_topo.c).
 */
#ifndef SP_TEXT_H
#define SP_TEXT_H

#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>

/* Appends to buf[len] at off and returns the new end; stops quietly once the
 * buffer is full (the end then stays at or past len, and later calls add
 * nothing), so a caller writes its pieces without checking each. */
static inline size_t sp_add_text(char *buf, size_t len, size_t off, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static inline size_t sp_add_text(char *buf, size_t len, size_t off, const char *fmt, ...)
{
    if (off >= len)
        return off;
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(buf + off, len - off, fmt, ap);
    va_end(ap);
    return n < 0 ? off : off + (size_t)n;
}

#endif /* SP_TEXT_H */
