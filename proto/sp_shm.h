/*
 * sp_shm.h — the shared-memory data plane: segment layout, rings, wake words.
 *
 * Each client gets one segment (a sealed memfd the daemon creates and passes over
 * SCM_RIGHTS). Both sides map it. Layout, every part page aligned:
 *
 *   sp_seg_hdr      layout of the rest; written once by the daemon
 *   sp_wake         wake words, one cache line each
 *   SQ ring header, SQ entries        client produces, daemon consumes
 *   SQ argument slots                 one per SQ entry: the op's tensors
 *   CQ ring header, CQ entries        daemon produces, client consumes
 *   CQ detail slots                   one per CQ entry: error text
 *   arena                             host buffers the daemon touches directly
 *
 * Rings are io_uring-like: power-of-two entries, free-running 32-bit head and
 * tail (index = counter & mask), the producer owns the tail, the consumer the
 * head. Entries are published with a release store of the tail and seen with an
 * acquire load of it; a slot is handed back with a release store of the head.
 *
 * Sleeping: a consumer that finds its ring empty may sleep (the client on
 * cq_futex, the daemon in epoll, below), but only after it has said so in a
 * wake word, and it re-checks the ring after saying it (a full barrier sits
 * between the two). A producer stores its tail, issues a full barrier, then
 * reads the wake word and wakes the sleeper only if it said it sleeps. Either
 * the consumer sees the new tail or the producer sees the flag.
 *
 * The daemon never trusts what a client wrote: it copies an SQ entry and its
 * arguments to private memory before looking at them, and checks head/tail
 * distances against the ring size.
 *
 * Waking the daemon: each client gets an eventfd of its own with its segment,
 * and the progress thread sleeps in epoll on all of them. The daemon watches
 * them edge-triggered and never reads them, so each write is one wake-up and
 * nothing else: whatever a client writes to (or reads from, or does with) its
 * eventfd, at worst the daemon wakes for nothing. No memory is shared between
 * clients, so a client cannot reach another's wake-ups or what the daemon
 * tells it.
 */
#ifndef SP_SHM_H
#define SP_SHM_H

#include <stdalign.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#define SP_SEG_MAGIC        0x3147455344505300ull  /* "\0SPDSEG1" little-endian */
#define SP_SEG_VERSION      5u   /* 5: 16 tensor refs, 2 KiB argument slots */
#define SP_SEG_VERSION_MIN  4u   /* 4: 8 tensor refs, 1 KiB argument slots (protocol 1's clients) */
#define SP_CACHELINE        64
#define SP_PAGE             4096u

#define SP_SQ_MIN_ENTRIES   8u
#define SP_SQ_MAX_ENTRIES   4096u
#define SP_CQ_PER_SQ        2u      /* CQ entries = 2 × SQ entries */

#define SP_MAX_TENSORS      16      /* tensor refs one op may name: an all-to-all's 8 (send, receive) pairs */
#define SP_MAX_DIMS         6
#define SP_DETAIL_BYTES     256     /* error text per CQ entry, NUL terminated */

/* Region 0 is always the client's own arena; registered regions get ids from 1. */
#define SP_REGION_ARENA     0u

/* ---------------------------------------------------------------- ops */

enum sp_opcode {
    SP_OP_NOOP      = 0,   /* completes at once: the round-trip probe */
    SP_OP_BARRIER   = 1,
    SP_OP_ALLREDUCE = 2,   /* tensors: [0] send, [1] receive (may alias send) */
    SP_OP_ALLTOALL  = 3,   /* tensors: (send, receive) pairs; params: struct sp_a2a_params */
    SP_OP_SHIFT     = 4,   /* tensors: (send, receive) pairs, each its own size; flags SP_SHIFT_F_* */
    SP_OP_ALLGATHER = 5,   /* tensors: [0] send (count), [1] receive (size x count) */
    SP_OP_BROADCAST = 6,   /* tensors: [0] the buffer; sqe.root sends */
    SP_OP_REDUCE_SCATTER = 7,   /* tensors: [0] send (size x count), [1] receive (count): block rank of the reduction */
    SP_OP_ALLTOALLV = 8,   /* tensors: [0] send, [1] receive; params: struct sp_a2av_params */
};

/* Independent sequence spaces of one group (sqe.channel): ops on different
 * channels never match each other, so forward KV and backward dKV rotations
 * never wait on each other's order. */
#define SP_CHANNELS 4u

/* sqe.flags of SP_OP_SHIFT. */
#define SP_SHIFT_F_LINEAR   1u   /* no wrap: the first rank receives zeros, the last one's data goes nowhere */
#define SP_SHIFT_F_REVERSE  2u   /* send to rank - 1, receive from rank + 1 */

/* ---------------------------------------------------------------- all-to-all
 *
 * Ulysses all-to-all over a group of P ranks. Each logical tensor i uses the
 * tensor refs 2i (send) and 2i + 1 (receive) and is [B, S, H, D] (BSHD) or
 * [S, B, H, D] (SBHD), with S and H as below. S_true = seq_len, S_loc =
 * ceil(S_true / P): rank p holds global rows [p S_loc, (p + 1) S_loc), the rows
 * past S_true being padding.
 *
 *   SEQ_TO_HEAD: send [.., S_loc, H, D] -> receive [.., S_true, H_loc, D]
 *   HEAD_TO_SEQ: send [.., S_true, H_loc, D] -> receive [.., S_loc, H, D]
 *                (padding rows written as zeros)
 *
 * Heads are dealt out in units: a tensor of H heads in n = kv_heads groups of
 * g = H / n (a key/value tensor: n = H, g = 1). With n >= P the units are padded
 * with zero dummy units to a multiple of P and dealt out in order. With n < P
 * (P a multiple of n, r = P / n) rank p works on unit p / r: a key/value tensor
 * is replicated to those r ranks; a query tensor's g heads are padded to a
 * multiple of r with dummy heads and split among them. HEAD_TO_SEQ drops
 * dummies and takes each replicated head from its first copy, or sums the r
 * copies in rank order (SP_A2A_T_SUM_REPLICAS: the gradient of replication).
 */
#define SP_A2A_MAX_TENSORS 8   /* GatedDeltaNet's q, k, v, beta and gate go in one op */

enum sp_a2a_direction {
    SP_A2A_SEQ_TO_HEAD = 0,
    SP_A2A_HEAD_TO_SEQ = 1,
};

enum sp_layout {
    SP_LAYOUT_BSHD = 0,   /* batch first */
    SP_LAYOUT_SBHD = 1,   /* sequence first */
};

enum sp_heads_kind {
    SP_HEADS_Q  = 0,      /* split among ranks (dummy heads when uneven) */
    SP_HEADS_KV = 1,      /* replicated when fewer than P */
};

#define SP_A2A_T_SUM_REPLICAS 1u

struct sp_a2a_tensor {
    uint32_t heads;       /* H, without dummies */
    uint32_t head_dim;    /* D */
    uint32_t kind;        /* enum sp_heads_kind */
    uint32_t flags;       /* SP_A2A_T_* */
};

struct sp_a2a_params {
    uint32_t direction;   /* enum sp_a2a_direction */
    uint32_t layout;      /* enum sp_layout */
    uint32_t batch;       /* B */
    uint32_t seq_len;     /* S_true: the global sequence length */
    uint32_t kv_heads;    /* groups of query heads (GQA); 0 = as many as heads */
    uint32_t ntensors;    /* logical tensors: 2 x ntensors tensor refs */
    uint32_t reserved[2];
    struct sp_a2a_tensor t[SP_A2A_MAX_TENSORS];
};

/* Layout 4 took all-to-alls of 4 tensors: its descriptor was the first bytes
 * of today's, and an spd of then wanted all of them. */
#define SP_A2A_V4_PARAM_BYTES (offsetof(struct sp_a2a_params, t) + 4 * sizeof(struct sp_a2a_tensor))

/* ---------------------------------------------------------------- uneven all-to-all
 *
 * SP_OP_ALLTOALLV over a group of P <= SP_A2AV_MAX_RANKS ranks: counts[j]
 * elements of the send go to rank j, counts[P + i] elements of the receive come
 * from rank i, each side packed in rank order (block j of the send starts at
 * the sum of counts[0, j)). param_bytes = 2 P x 8. Rank i's counts[j] must be
 * rank j's counts[P + i].
 */
#define SP_A2AV_MAX_RANKS 64

struct sp_a2av_params {
    uint64_t counts[2 * SP_A2AV_MAX_RANKS];   /* elements: P sends, then P receives */
};

enum sp_dtype {
    SP_DTYPE_NONE = 0,
    SP_DTYPE_F32  = 1,
    SP_DTYPE_F64  = 2,
    SP_DTYPE_F16  = 3,
    SP_DTYPE_BF16 = 4,
    SP_DTYPE_I32  = 5,
    SP_DTYPE_I64  = 6,
    SP_DTYPE_U8   = 7,
};

enum sp_redop {
    SP_REDOP_SUM = 0,
    SP_REDOP_MAX = 1,
    SP_REDOP_MIN = 2,
};

/* Bytes per element of a wire dtype; 0 when unknown. */
static inline size_t sp_dtype_size(unsigned dtype)
{
    switch (dtype) {
    case SP_DTYPE_F32: case SP_DTYPE_I32: return 4;
    case SP_DTYPE_F64: case SP_DTYPE_I64: return 8;
    case SP_DTYPE_F16: case SP_DTYPE_BF16: return 2;
    case SP_DTYPE_U8: return 1;
    }
    return 0;
}

/* "fp32", "bf16", ...; "unknown" when unknown. */
static inline const char *sp_dtype_name(unsigned dtype)
{
    switch (dtype) {
    case SP_DTYPE_F32:  return "fp32";
    case SP_DTYPE_F64:  return "fp64";
    case SP_DTYPE_F16:  return "fp16";
    case SP_DTYPE_BF16: return "bf16";
    case SP_DTYPE_I32:  return "int32";
    case SP_DTYPE_I64:  return "int64";
    case SP_DTYPE_U8:   return "uint8";
    }
    return "unknown";
}

/* One submission entry: one cache line. Tensors live in the entry's argument slot. */
struct sp_sqe {
    uint8_t  opcode;        /* enum sp_opcode */
    uint8_t  dtype;         /* enum sp_dtype: element type */
    uint8_t  redop;         /* enum sp_redop */
    uint8_t  ntensors;      /* used entries of the argument slot */
    uint32_t group;         /* group the op runs on; 0 for NOOP */
    uint32_t timeout_ms;    /* 0 = the daemon's op_timeout_ms */
    uint32_t flags;         /* op-specific (SP_SHIFT_F_*); 0 elsewhere */
    uint64_t user_data;     /* returned verbatim in the completion */
    uint64_t count;         /* elements per rank (allreduce, allgather, broadcast) */
    uint32_t root;          /* broadcast: the group rank that sends */
    uint8_t  channel;       /* < SP_CHANNELS */
    uint8_t  replay;        /* SP_REPLAY_*: an op a client brings back to a new spd; 0 otherwise */
    uint8_t  reserved8[2];
    uint32_t param_bytes;   /* bytes of the argument slot's params in use */
    uint32_t stream;        /* stream order: the client's stream slot + 1; 0 = none */
    uint64_t stream_seq;    /* stream order: the op's place on that stream, from 1 */
    uint64_t replay_seq;    /* SP_REPLAY_SEQ: its sequence number on its group's channel */
};

/*
 * A replayed op (sp_sqe.replay): one submitted to an spd that went before
 * completing it, submitted again to the spd that adopted the client
 * (docs/architecture.md, "Restarting spd under running jobs"). SEQ: it keeps
 * the sequence number it had (replay_seq), so the ranks' ops still meet.
 * TAKEN: the old spd had taken it off the SQ, so its collective may have run,
 * whole or in part. ALIASED: its outputs overlap its inputs (an all-reduce in
 * place), so running it again after a partial run would read what the first
 * run wrote. A collective every rank of which replays TAKEN, and one of which
 * replays ALIASED, fails with SPC_ERR_RESTARTED instead of running.
 */
#define SP_REPLAY_SEQ     0x1u
#define SP_REPLAY_TAKEN   0x2u
#define SP_REPLAY_ALIASED 0x4u

/* A buffer named by region and offset: requests never carry raw pointers. */
struct sp_tensor_ref {
    uint32_t region;        /* SP_REGION_ARENA or a registered region id */
    uint8_t  dtype;
    uint8_t  ndim;          /* 0 = flat `bytes` */
    uint16_t flags;         /* reserved, 0 */
    uint64_t offset;        /* bytes from the start of the region */
    uint64_t bytes;         /* extent the op may touch */
    uint32_t shape[SP_MAX_DIMS];
    uint32_t reserved[4];
};

/* The argument slot of one SQ entry: 2 KiB, half tensor refs, half params.
 * Layout 4 had half as much: 8 refs, then 512 bytes of params. The layout
 * of a segment (its header's version) says which (sp_seg_slot). */
struct sp_sq_args {
    struct sp_tensor_ref tensor[SP_MAX_TENSORS];
    uint8_t params[2048 - SP_MAX_TENSORS * sizeof(struct sp_tensor_ref)];
};

/* One argument slot, wherever it is and whichever layout placed it. */
struct sp_sq_slot {
    const struct sp_tensor_ref *tensor;   /* [max_tensors] */
    const uint8_t              *params;   /* [max_params] */
    uint32_t                    max_tensors, max_params;
};

/* A slot of today's layout (a copy, or the fuzzers'). */
static inline struct sp_sq_slot sp_sq_slot_of(const struct sp_sq_args *a)
{
    return (struct sp_sq_slot){ a->tensor, a->params, SP_MAX_TENSORS, sizeof a->params };
}

/* What an argument slot of segment layout `version` is: its bytes and its tensor refs. */
static inline uint32_t sp_seg_slot_bytes(uint32_t version)
{
    return version >= 5 ? 2048u : 1024u;
}
static inline uint32_t sp_seg_slot_tensors(uint32_t version)
{
    return version >= 5 ? SP_MAX_TENSORS : 8u;
}

/* One completion entry. */
struct sp_cqe {
    uint64_t user_data;     /* from the sqe */
    int32_t  status;        /* spc_status_t */
    uint32_t flags;         /* SP_CQE_F_* */
    uint64_t result;        /* op-specific */
    uint64_t reserved;
};
#define SP_CQE_F_DETAIL 1u  /* the entry's detail slot holds text */

/* ---------------------------------------------------------------- layout */

/* Only the counters live in shared memory; sizes come from each side's own copy of
 * the layout, never from a word the other side could have rewritten. */
struct sp_ring {
    alignas(SP_CACHELINE) _Atomic uint32_t head;    /* written by the consumer */
    alignas(SP_CACHELINE) _Atomic uint32_t tail;    /* written by the producer */
};

enum sp_daemon_state {
    SP_DAEMON_RUNNING  = 0,
    SP_DAEMON_DRAINING = 1,   /* finishing in-flight ops; new ones are refused */
    SP_DAEMON_GONE     = 2,   /* the daemon has let go of this segment */
};

struct sp_wake {
    /* Daemon → client: "my progress thread is about to sleep; after publishing
     * an SQ entry, write to your wake eventfd". */
    alignas(SP_CACHELINE) _Atomic uint32_t sq_need_wakeup;
    /* Client → daemon: "I am (about to be) asleep on cq_futex", as the CPU the
     * client sleeps on plus one (0: not waiting). The daemon wakes the client
     * and, if that is its own CPU, moves its progress thread elsewhere. */
    alignas(SP_CACHELINE) _Atomic uint32_t cq_waiting;
    alignas(SP_CACHELINE) _Atomic uint32_t cq_futex;
    /* enum sp_daemon_state; the daemon bumps cq_futex after changing it. */
    alignas(SP_CACHELINE) _Atomic uint32_t daemon_state;
    /* Daemon → client: the CPU its progress thread last ran on (UINT32_MAX:
     * not known), stored when it changes. A waiting client on the same CPU
     * sleeps instead of spinning: spinning there only keeps the daemon from
     * running, and the wake-up lets the scheduler move one of the two to an
     * idle CPU. The daemon never reads it back. */
    alignas(SP_CACHELINE) _Atomic uint32_t progress_cpu;
};

/*
 * Stream order (spclient.h, "GPU streams"): one pair of 64-bit timeline
 * semaphores per client stream, each on its own cache line, in one page of the
 * segment that both sides register with CUDA. The client's CUDA stream writes
 * `ready` and waits on `done`; the daemon's stream waits on `ready` and writes
 * `done`. The daemon also stores to them from the host, to give up on a stream
 * (SP_STREAM_POISON in done, and in ready of a stream it will no longer wait for).
 */
#define SP_STREAMS_MAX      32
#define SP_STREAM_POISON    (UINT64_C(1) << 63)

struct sp_stream_sem {
    alignas(SP_CACHELINE) volatile uint64_t ready;
    alignas(SP_CACHELINE) volatile uint64_t done;
};

struct sp_seg_hdr {
    uint64_t magic;
    uint32_t version;
    uint32_t sq_entries;
    uint32_t cq_entries;
    uint32_t reserved0;
    uint64_t client_id;
    uint64_t segment_bytes;
    uint64_t wake_off;
    uint64_t sq_off;          /* struct sp_ring, then sp_sqe[sq_entries] */
    uint64_t sqe_off;
    uint64_t sq_args_off;     /* sq_entries argument slots (sp_seg_slot_bytes) */
    uint64_t cq_off;
    uint64_t cqe_off;
    uint64_t cq_detail_off;   /* char[SP_DETAIL_BYTES][cq_entries] */
    uint64_t arena_off;
    uint64_t arena_bytes;
    uint64_t sem_off;         /* struct sp_stream_sem[SP_STREAMS_MAX], one page */
};

_Static_assert(sizeof(struct sp_sqe) == 64, "an SQ entry is one cache line");
_Static_assert(sizeof(struct sp_tensor_ref) == 64, "tensor refs pack the argument slot");
_Static_assert(sizeof(struct sp_sq_args) == 2048, "argument slots are 2 KiB");
_Static_assert(sizeof(struct sp_cqe) == 32, "two completions per cache line");
_Static_assert(sizeof(struct sp_stream_sem) * SP_STREAMS_MAX == SP_PAGE, "the stream semaphores fill one page");
_Static_assert(sizeof(struct sp_a2a_params) <= sizeof(((struct sp_sq_args *)0)->params), "all-to-all params fit the slot");
_Static_assert(sizeof(struct sp_a2av_params) <= sizeof(((struct sp_sq_args *)0)->params), "alltoallv params fit the slot");

static inline uint64_t sp_align_up(uint64_t v, uint64_t a)
{
    return (v + a - 1) & ~(a - 1);
}

/*
 * Computes the layout `version` (SP_SEG_VERSION_MIN to SP_SEG_VERSION) of a
 * segment with `sq_entries` (a power of two) and an arena of `arena_bytes` into
 * *h. Both sides call it: the daemon to build the segment, the client to check
 * the header the daemon wrote.
 */
static inline void sp_seg_layout(struct sp_seg_hdr *h, uint32_t version, uint32_t sq_entries, uint64_t arena_bytes)
{
    uint32_t cq_entries = sq_entries * SP_CQ_PER_SQ;
    uint64_t off = SP_PAGE;                          /* page 0: this header */

    h->magic = SP_SEG_MAGIC;
    h->version = version;
    h->sq_entries = sq_entries;
    h->cq_entries = cq_entries;
    h->reserved0 = 0;
    h->wake_off = off;
    off = sp_align_up(off + sizeof(struct sp_wake), SP_PAGE);
    h->sem_off = off;
    off += SP_PAGE;
    h->sq_off = off;
    h->sqe_off = off + sp_align_up(sizeof(struct sp_ring), SP_CACHELINE);
    off = sp_align_up(h->sqe_off + (uint64_t)sq_entries * sizeof(struct sp_sqe), SP_PAGE);
    h->sq_args_off = off;
    off = sp_align_up(off + (uint64_t)sq_entries * sp_seg_slot_bytes(version), SP_PAGE);
    h->cq_off = off;
    h->cqe_off = off + sp_align_up(sizeof(struct sp_ring), SP_CACHELINE);
    off = sp_align_up(h->cqe_off + (uint64_t)cq_entries * sizeof(struct sp_cqe), SP_PAGE);
    h->cq_detail_off = off;
    off = sp_align_up(off + (uint64_t)cq_entries * SP_DETAIL_BYTES, SP_PAGE);
    h->arena_off = off;
    h->arena_bytes = sp_align_up(arena_bytes, SP_PAGE);
    h->segment_bytes = off + h->arena_bytes;
}

/* Pointers into one mapped segment. */
struct sp_seg_view {
    uint8_t             *base;
    struct sp_wake      *wake;
    struct sp_ring      *sq;
    struct sp_sqe       *sqes;
    uint8_t             *sq_args;       /* argument slots of slot_bytes: sp_seg_slot */
    uint32_t             slot_bytes, slot_tensors;
    struct sp_ring      *cq;
    struct sp_cqe       *cqes;
    char                *cq_detail;
    struct sp_stream_sem *sems;
    uint8_t             *arena;
    uint64_t             arena_bytes;
};

/* Fills *v from a mapped segment whose header `h` has already been checked. */
static inline void sp_seg_view_init(struct sp_seg_view *v, void *base, const struct sp_seg_hdr *h)
{
    uint8_t *b = (uint8_t *)base;

    v->base = b;
    v->wake = (struct sp_wake *)(b + h->wake_off);
    v->sq = (struct sp_ring *)(b + h->sq_off);
    v->sqes = (struct sp_sqe *)(b + h->sqe_off);
    v->sq_args = b + h->sq_args_off;
    v->slot_bytes = sp_seg_slot_bytes(h->version);
    v->slot_tensors = sp_seg_slot_tensors(h->version);
    v->cq = (struct sp_ring *)(b + h->cq_off);
    v->cqes = (struct sp_cqe *)(b + h->cqe_off);
    v->cq_detail = (char *)(b + h->cq_detail_off);
    v->sems = (struct sp_stream_sem *)(b + h->sem_off);
    v->arena = b + h->arena_off;
    v->arena_bytes = h->arena_bytes;
}

/* The tensor refs and the params of SQ entry idx's argument slot. */
static inline struct sp_tensor_ref *sp_seg_slot_tensor(const struct sp_seg_view *v, uint32_t idx)
{
    return (struct sp_tensor_ref *)(v->sq_args + (size_t)idx * v->slot_bytes);
}
static inline uint8_t *sp_seg_slot_params(const struct sp_seg_view *v, uint32_t idx)
{
    return v->sq_args + (size_t)idx * v->slot_bytes + v->slot_tensors * sizeof(struct sp_tensor_ref);
}
static inline uint32_t sp_seg_slot_max_params(const struct sp_seg_view *v)
{
    return v->slot_bytes - v->slot_tensors * (uint32_t)sizeof(struct sp_tensor_ref);
}
static inline struct sp_sq_slot sp_seg_slot(const struct sp_seg_view *v, uint32_t idx)
{
    return (struct sp_sq_slot){ sp_seg_slot_tensor(v, idx), sp_seg_slot_params(v, idx), v->slot_tensors,
                                sp_seg_slot_max_params(v) };
}

/* ---------------------------------------------------------------- ordering helpers
 *
 * Every access to a word the other process also touches goes through one of these,
 * so that each ordering decision has a name and, at its call site, a reason.
 */

/* Acquire: the entries the producer wrote before publishing this counter are visible. */
static inline uint32_t sp_load_acquire(_Atomic uint32_t *p)
{
    return atomic_load_explicit(p, memory_order_acquire);
}

/* Release: everything written before (entries, detail text) is visible to whoever
 * acquires this store. */
static inline void sp_store_release(_Atomic uint32_t *p, uint32_t v)
{
    atomic_store_explicit(p, v, memory_order_release);
}

/* Our own counter, or a word whose value alone matters: no ordering needed. */
static inline uint32_t sp_load_relaxed(_Atomic uint32_t *p)
{
    return atomic_load_explicit(p, memory_order_relaxed);
}

static inline void sp_store_relaxed(_Atomic uint32_t *p, uint32_t v)
{
    atomic_store_explicit(p, v, memory_order_relaxed);
}

/* Full barrier: orders a store before a later load (store tail → load flag,
 * store flag → load tail). Release/acquire alone never orders store→load. */
static inline void sp_smp_mb(void)
{
    atomic_thread_fence(memory_order_seq_cst);
}

/* Entries ready for the consumer; the producer's tail is read with acquire. */
static inline uint32_t sp_ring_ready(struct sp_ring *r, uint32_t head)
{
    return sp_load_acquire(&r->tail) - head;
}

/* Slots in use as the producer sees them; the consumer's head is read with acquire
 * so that its reads of the slots it handed back are done before we overwrite them.
 * A result above the ring's size means the other side corrupted the head. */
static inline uint32_t sp_ring_used(struct sp_ring *r, uint32_t tail)
{
    return tail - sp_load_acquire(&r->head);
}

/* A CPU hint for spin loops. */
static inline void sp_cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield" ::: "memory");
#endif
}

#endif /* SP_SHM_H */
