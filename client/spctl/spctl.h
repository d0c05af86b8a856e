/*
 * spctl.h — what the parts of spctl share.
 */
#ifndef SPCTL_H
#define SPCTL_H

/* Writes s as a JSON string (quoted and escaped) to stdout. */
void spctl_json_string(const char *s);

#endif /* SPCTL_H */
