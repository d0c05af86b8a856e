/* sp_place.c — placement of a mesh's groups and the communication model. See sp_place.h. */
#include "sp_place.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sp_err.h"
#include "sp_text.h"
#include "sp_ulysses.h"

#define MAX_HEADS      65536u
/* Domain keys: an island is its id; a NUMA node sits above every island id so
 * the two kinds never compare equal. */
#define DOMAIN_NUMA    (1 << 20)
#define STR_(x)        #x
#define STR(x)         STR_(x)


/* ---------------------------------------------------------------- heads */

/* How a ulysses degree holds the heads (sp_ulysses.h decides; this counts). */
typedef struct heads_fit {
    const char *refused;                /* NULL: it can */
    uint32_t    lq, lkv;                /* heads per rank after seq->head */
    uint32_t    q_heads, kv_heads;      /* over the group: u * lq, u * lkv */
    uint32_t    q_dummies, kv_dummies;
    uint64_t    real, moved;            /* heads of q, k, v, o without and with dummies */
} heads_fit_t;

static void heads_fit(uint32_t u, uint32_t heads, uint32_t kv, heads_fit_t *f)
{
    sp_heads_plan_t q, k;

    memset(f, 0, sizeof *f);
    if (u > heads) {
        f->refused = "more ranks than heads";
        return;
    }
    if (!sp_heads_plan(&q, heads, SP_HEADS_Q, kv, u) || !sp_heads_plan(&k, kv, SP_HEADS_KV, kv, u)) {
        f->refused = "cannot replicate the kv heads evenly";
        return;
    }
    f->lq = q.local;
    f->lkv = k.local;
    f->q_heads = u * q.local;
    f->kv_heads = u * k.local;
    /* Replicas are copies every rank needs, not dummies. */
    uint32_t kv_real = kv >= u ? kv : u;
    f->q_dummies = f->q_heads - heads;
    f->kv_dummies = f->kv_heads - kv_real;
    f->real = 2 * ((uint64_t)heads + kv_real);
    f->moved = 2 * ((uint64_t)f->q_heads + f->kv_heads);
}

static uint32_t dummy_pct(const heads_fit_t *f)
{
    return (uint32_t)((f->moved - f->real) * 100 / f->real);
}

/* ---------------------------------------------------------------- the model, in units */

/* What a placement with ulysses u sends, in units (sp_place.h). */
typedef struct tally {
    uint64_t ul[SP_LINKS], ring[SP_LINKS];
    uint64_t inter_domain;              /* part of the intra-node units */
    uint64_t rank_max[SP_LINKS];
    uint32_t spanning, hops, hops_inter;
} tally_t;

/*
 * Slots are sorted by node and domain, so the members of a Ulysses group (u
 * consecutive slots) that share a node are one run of it, and those that
 * share a domain one run inside that: each member's peers on its node and in
 * its domain are run lengths, and the whole tally is one pass over the slots.
 * An unknown domain (-1) counts as the same domain as every rank of the node.
 */
static void tally(const uint32_t *node, const int32_t *dom, uint32_t world, uint32_t sp, uint32_t u, uint32_t lq,
                  uint32_t lkv, tally_t *t)
{
    uint32_t ring = sp / u;
    uint64_t per_peer = 4 * ((uint64_t)lq + lkv);
    uint64_t ring_units = ring > 1 ? 4 * (uint64_t)(ring - 1) * u * lkv : 0;

    memset(t, 0, sizeof *t);
    for (uint32_t base = 0; base < world; base += u) {
        uint32_t end = base + u;
        t->spanning += node[base] != node[end - 1];
        for (uint32_t a = base, b; a < end; a = b) {
            uint32_t unknown = 0;
            for (b = a; b < end && node[b] == node[a]; b++)
                unknown += dom[b] < 0;
            uint64_t same_node = b - a - 1;
            for (uint32_t x = a, y; x < b; x = y) {
                for (y = x; y < b && dom[y] == dom[x]; y++)
                    ;
                uint64_t same_dom = dom[x] < 0 ? same_node : (uint64_t)(y - x - 1) + unknown;
                for (uint32_t m = x; m < y; m++) {
                    uint64_t mine[SP_LINKS] = { same_node * per_peer, (u - 1 - same_node) * per_peer };
                    t->ul[SP_LINK_INTRA] += mine[SP_LINK_INTRA];
                    t->ul[SP_LINK_INTER] += mine[SP_LINK_INTER];
                    t->inter_domain += (same_node - same_dom) * per_peer;
                    if (ring > 1) {
                        uint32_t r = m % sp, k = r / u, j = r % u;
                        uint32_t next = m - r + ((k + 1) % ring) * u + j;
                        int link = node[next] != node[m] ? SP_LINK_INTER : SP_LINK_INTRA;
                        t->ring[link] += ring_units;
                        mine[link] += ring_units;
                        t->hops++;
                        t->hops_inter += link == SP_LINK_INTER;
                        if (link == SP_LINK_INTRA && dom[m] >= 0 && dom[next] >= 0 && dom[m] != dom[next])
                            t->inter_domain += ring_units;
                    }
                    for (int l = 0; l < SP_LINKS; l++)
                        if (mine[l] > t->rank_max[l])
                            t->rank_max[l] = mine[l];
                }
            }
        }
    }
}

/* ---------------------------------------------------------------- slots */

typedef struct rank_key {
    uint32_t node;
    int32_t  order;     /* a GPU rank: its GPU's place in the node's link order; a host rank: its domain */
    int32_t  domain;
    int32_t  gpos;      /* its GPU's position in the node's gpus[]; -1: a host rank */
    uint32_t rank;
} rank_key_t;

static int key_cmp(const void *a, const void *b)
{
    const rank_key_t *x = a, *y = b;
    if (x->node != y->node)
        return x->node < y->node ? -1 : 1;
    if (x->order != y->order)
        return x->order < y->order ? -1 : 1;
    return x->rank < y->rank ? -1 : x->rank > y->rank;
}

/* A node's GPUs, by position in its gpus[]: their place in the link order and
 * their fast domain. */
typedef struct gpu_order {
    int32_t order[SP_TOPO_MAX_GPUS];
    int32_t domain[SP_TOPO_MAX_GPUS];
} gpu_order_t;

/* comp[k]: the lowest position joined to k by links no slower than `worst`.
 * Each component is walked once from its lowest position: n^2 steps. */
static void components(uint32_t n, const int8_t link[SP_TOPO_MAX_GPUS][SP_TOPO_MAX_GPUS], int worst, int32_t *comp)
{
    int32_t stack[SP_TOPO_MAX_GPUS];
    for (uint32_t k = 0; k < n; k++)
        comp[k] = -1;
    for (uint32_t first = 0; first < n; first++) {
        if (comp[first] >= 0)
            continue;
        int top = 0;
        comp[first] = (int32_t)first;
        stack[top++] = (int32_t)first;
        while (top > 0) {
            int32_t a = stack[--top];
            for (uint32_t b = 0; b < n; b++) {
                if (comp[b] < 0 && link[a][b] >= 0 && link[a][b] <= worst) {
                    comp[b] = (int32_t)first;
                    stack[top++] = (int32_t)b;
                }
            }
        }
    }
}

static int i64_cmp(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return x < y ? -1 : x > y;
}

/*
 * The link order of a node's GPUs (sp_place.h, rule 1): GPUs joined by
 * faster links are closer. GPUs are grouped by the components of each link
 * class, coarsest first: across sockets, then one host bridge, PCIe bridges,
 * one switch, NVLink; inside the finest group, by index. So a block of
 * consecutive GPUs stays inside one NVLink island where it fits, else inside
 * one switch, and so on. A GPU's domain is its group at the fastest class
 * that joins any two GPUs of the node (NVLink islands, else PCIe switches,
 * ...); -1 when no link of the node is known.
 */
static void node_gpu_order(const sp_topo_node_t *n, gpu_order_t *o)
{
    int32_t comp[SP_TOPO_LINKS][SP_TOPO_MAX_GPUS];
    int8_t link[SP_TOPO_MAX_GPUS][SP_TOPO_MAX_GPUS];
    int64_t key[SP_TOPO_MAX_GPUS];
    int fast = -1;

    sp_topo_link_matrix(n, false, link);
    for (int lv = 0; lv < SP_TOPO_LINKS; lv++) {
        components(n->ngpus, (const int8_t (*)[SP_TOPO_MAX_GPUS])link, lv, comp[lv]);
        for (uint32_t k = 0; k < n->ngpus && fast < 0; k++)
            if (comp[lv][k] != (int32_t)k)
                fast = lv;
    }
    /* One number per GPU, its groups from the coarsest down and its position
     * last, six digits of base 64 (positions are below SP_TOPO_MAX_GPUS). */
    for (uint32_t k = 0; k < n->ngpus; k++) {
        key[k] = 0;
        for (int lv = SP_TOPO_LINKS - 1; lv >= 0; lv--)
            key[k] = key[k] * SP_TOPO_MAX_GPUS + comp[lv][k];
        key[k] = key[k] * SP_TOPO_MAX_GPUS + k;
    }
    qsort(key, n->ngpus, sizeof *key, i64_cmp);
    for (uint32_t i = 0; i < n->ngpus; i++) {
        int32_t k = (int32_t)(key[i] % SP_TOPO_MAX_GPUS);
        o->order[k] = (int32_t)i;
        o->domain[k] = fast >= 0 ? comp[fast][k] : -1;
    }
}

/* The sort key of each rank, from its location. topo NULL: one node, nothing
 * known about it. orders[node] is the node's GPU order, made on first use. */
static spc_status_t rank_keys(const sp_topo_t *topo, const sp_place_loc_t *locs, uint32_t world, rank_key_t *keys,
                              gpu_order_t **orders, char *err, size_t errlen)
{
    for (uint32_t r = 0; r < world; r++) {
        const sp_place_loc_t *l = &locs[r];
        rank_key_t *k = &keys[r];
        *k = (rank_key_t){ .node = l->node, .order = -1, .domain = -1, .gpos = -1, .rank = r };
        if (topo == NULL) {
            if (l->node != 0 || l->gpu != -1 || l->numa != -1) {
                sp_errf(err, errlen, "rank %u: a location (node %u, gpu %d, numa %d) without a topology", r, l->node,
                     (int)l->gpu, (int)l->numa);
                return SPC_ERR_INVALID_ARG;
            }
            continue;
        }
        if (l->node >= topo->nnodes) {
            sp_errf(err, errlen, "rank %u: node %u is not in the topology (%u nodes)", r, l->node, topo->nnodes);
            return SPC_ERR_INVALID_ARG;
        }
        const sp_topo_node_t *n = &topo->nodes[l->node];
        if (l->gpu >= 0) {
            const sp_topo_gpu_t *g = sp_topo_find_gpu(n, l->gpu);
            if (g == NULL) {
                sp_errf(err, errlen, "rank %u: node %s has no GPU %d", r, n->name, (int)l->gpu);
                return SPC_ERR_INVALID_ARG;
            }
            if (orders[l->node] == NULL) {
                if ((orders[l->node] = malloc(sizeof **orders)) == NULL) {
                    sp_errf(err, errlen, "out of memory placing %u ranks", world);
                    return SPC_ERR_NO_MEMORY;
                }
                node_gpu_order(n, orders[l->node]);
            }
            k->gpos = (int32_t)(g - n->gpus);
            k->order = orders[l->node]->order[k->gpos];
            k->domain = orders[l->node]->domain[k->gpos];
        } else if (l->numa >= 0) {
            if (sp_topo_find_numa(n, l->numa) == NULL) {
                sp_errf(err, errlen, "rank %u: node %s has no NUMA node %d", r, n->name, (int)l->numa);
                return SPC_ERR_INVALID_ARG;
            }
            k->order = k->domain = DOMAIN_NUMA + l->numa;
        } else if (l->gpu != -1 || l->numa != -1) {
            sp_errf(err, errlen, "rank %u: gpu %d and numa %d must be -1 or an index", r, (int)l->gpu, (int)l->numa);
            return SPC_ERR_INVALID_ARG;
        }
    }
    return SPC_OK;
}

/* ---------------------------------------------------------------- degrees */

static const char *const WHY_LARGEST =
    "the largest divisor of sp that divides the heads without dummies and fits the kv heads";
static const char *const WHY_NODE = "the fewest inter-node bytes with its all-to-all inside a node";
static const char *const WHY_DOMAIN =
    "the fewest bytes between NVLink islands, PCIe switches or NUMA nodes with its all-to-all inside a node";

/* Whether candidate a is better than b (both eligible). */
static bool cand_better(const sp_place_cand_t *a, const sp_place_cand_t *b)
{
    if (a->inter_node != b->inter_node)
        return a->inter_node < b->inter_node;
    if (a->inter_domain != b->inter_domain)
        return a->inter_domain < b->inter_domain;
    if ((a->dummies > 0) != (b->dummies > 0))
        return a->dummies == 0;
    return a->ulysses > b->ulysses;
}

/*
 * Chooses ulysses among the divisors of sp (sp_place.h, rule 2). Fills p->cand
 * and returns the winner's index, or -1 when out of memory. *why_p says why.
 */
static int choose_ulysses(sp_place_t *p, uint32_t kv, const char **why_p)
{
    uint32_t n = 0;
    for (uint32_t d = 1; d <= p->sp; d++)
        n += p->sp % d == 0;
    if ((p->cand = calloc(n, sizeof *p->cand)) == NULL)
        return -1;
    int best = -1;
    for (uint32_t d = 1; d <= p->sp; d++) {
        if (p->sp % d != 0)
            continue;
        sp_place_cand_t *c = &p->cand[p->ncand++];
        heads_fit_t f;
        tally_t t;
        heads_fit(d, p->heads, kv, &f);
        c->ulysses = d;
        c->ring = p->sp / d;
        if ((c->refused = f.refused) != NULL)
            continue;
        c->q_heads = f.q_heads;
        c->kv_heads = f.kv_heads;
        c->dummies = f.q_dummies + f.kv_dummies;
        c->dummy_pct = dummy_pct(&f);
        tally(p->node, p->domain, p->world, p->sp, d, f.lq, f.lkv, &t);
        c->spanning = t.spanning;
        c->inter_node = t.ul[SP_LINK_INTER] + t.ring[SP_LINK_INTER];
        c->inter_domain = t.inter_domain;
        if ((f.moved - f.real) * 100 > (uint64_t)SP_PLACE_MAX_DUMMY_PCT * f.real)
            c->refused = "dummy heads would add more than " STR(SP_PLACE_MAX_DUMMY_PCT) "% to the all-to-all bytes";
        else if (t.spanning > 0)
            c->refused = "its all-to-all would span nodes";
        else if (best < 0 || cand_better(c, &p->cand[best]))
            best = (int)(c - p->cand);
    }
    /* Ulysses 1 has no dummies and spans nothing: there is always a winner. */
    bool node_ties = true, domain_ties = true;
    for (uint32_t i = 0; i < p->ncand; i++) {
        const sp_place_cand_t *c = &p->cand[i];
        if (c->refused != NULL)
            continue;
        node_ties &= c->inter_node == p->cand[best].inter_node;
        domain_ties &= c->inter_domain == p->cand[best].inter_domain;
    }
    *why_p = node_ties && domain_ties ? WHY_LARGEST : !node_ties ? WHY_NODE : WHY_DOMAIN;
    return best;
}

static void explain(sp_place_t *p, const heads_fit_t *f, const char *why)
{
    size_t len = sizeof p->explain;
    size_t off = sp_add_text(p->explain, len, 0, "dp %u x sp %u (ulysses %u x ring %u); ulysses %u: %s", p->dp, p->sp,
                          p->ulysses, p->ring, p->ulysses, why);
    if (f->q_dummies > 0 || f->kv_dummies > 0) {
        off = sp_add_text(p->explain, len, off, "; %u dummy head%s %u to %u", f->q_dummies,
                       f->q_dummies == 1 ? " pads" : "s pad", p->heads, f->q_heads);
        if (f->kv_dummies > 0)
            off = sp_add_text(p->explain, len, off, " and %u dummy kv head%s %u to %u", f->kv_dummies,
                           f->kv_dummies == 1 ? " pads" : "s pad", p->kv_heads, f->kv_heads);
        off = sp_add_text(p->explain, len, off, " (+%u%% all-to-all bytes)", dummy_pct(f));
    }
    if (p->kv_heads < p->ulysses)
        off = sp_add_text(p->explain, len, off, "; kv heads replicated %u times", p->ulysses / p->kv_heads);
    if (p->ulysses_spanning > 0)
        sp_add_text(p->explain, len, off, "; %u of %u ulysses groups span nodes", p->ulysses_spanning,
                 p->world / p->ulysses);
}

/*
 * Says over which GPU links the Ulysses groups run: for each group of GPU
 * ranks on one node, the slowest link between two of its GPUs, as the
 * topology states it (p2p lines, NVLink islands; not what NUMA nodes imply),
 * counted by link: "; slowest GPU link of the 2 ulysses groups: NVLink in 2".
 * Nothing when no group's links are stated. `keys` are in slot order.
 */
static void explain_links(sp_place_t *p, const sp_topo_t *topo, const rank_key_t *keys)
{
    int8_t link[SP_TOPO_MAX_GPUS][SP_TOPO_MAX_GPUS];
    uint32_t count[SP_TOPO_LINKS] = { 0 }, unknown = 0, groups = p->world / p->ulysses, cached = UINT32_MAX;

    if (p->ulysses < 2)
        return;
    for (uint32_t base = 0; base < p->world; base += p->ulysses) {
        const rank_key_t *g = &keys[base];
        int worst = SP_TOPO_LINK_UNKNOWN;
        bool known = true;
        for (uint32_t i = 0; i < p->ulysses && known; i++)
            known = g[i].gpos >= 0 && g[i].node == g[0].node;
        if (known && g[0].node != cached) {
            sp_topo_link_matrix(&topo->nodes[g[0].node], true, link);
            cached = g[0].node;
        }
        for (uint32_t i = 0; i < p->ulysses && known; i++) {
            for (uint32_t j = i + 1; j < p->ulysses && known; j++) {
                if (g[i].gpos == g[j].gpos)
                    continue;   /* two ranks on one GPU: no link between them */
                int l = link[g[i].gpos][g[j].gpos];
                known = l != SP_TOPO_LINK_UNKNOWN;
                worst = l > worst ? l : worst;
            }
        }
        if (known && worst != SP_TOPO_LINK_UNKNOWN)
            count[worst]++;
        else
            unknown++;
    }
    if (unknown == groups)
        return;
    size_t len = sizeof p->explain, off = strlen(p->explain);
    off = sp_add_text(p->explain, len, off, "; slowest GPU link of the %u ulysses groups:", groups);
    const char *sep = " ";
    for (int l = 0; l < SP_TOPO_LINKS; l++) {
        if (count[l] == 0)
            continue;
        off = sp_add_text(p->explain, len, off, "%s%s in %u", sep, sp_topo_link_words(l), count[l]);
        sep = ", ";
    }
    if (unknown > 0)
        sp_add_text(p->explain, len, off, ", unknown in %u", unknown);
}

static void free_orders(gpu_order_t **orders, const sp_topo_t *topo)
{
    if (orders == NULL)
        return;
    for (uint32_t i = 0; i < topo->nnodes; i++)
        free(orders[i]);
    free(orders);
}

/* ---------------------------------------------------------------- the placement */

void sp_place_free(sp_place_t *p)
{
    if (p == NULL)
        return;
    free(p->order);
    free(p->slot);
    free(p->node);
    free(p->domain);
    free(p->cand);
    free(p);
}

spc_status_t sp_place_compute(const sp_topo_t *topo, const sp_place_loc_t *locs, uint32_t world,
                              const sp_place_spec_t *spec, sp_place_t **place_p, char *err, size_t errlen)
{
    uint32_t sp = spec->sp, u = spec->ulysses, ring = spec->ring;
    uint32_t heads = spec->heads, kv = spec->kv_heads ? spec->kv_heads : spec->heads;
    const char *why;
    spc_status_t st = SPC_ERR_INVALID_ARG;
    sp_place_t *p = NULL;
    rank_key_t *keys = NULL;
    gpu_order_t **orders = NULL;

    /* The checks and their messages are those meshes have always given. */
    if (world == 0 || world > SP_PLACE_MAX_WORLD) {
        sp_errf(err, errlen, "a world of %u ranks is outside [1, %u]", world, SP_PLACE_MAX_WORLD);
        return world == 0 ? SPC_ERR_INVALID_ARG : SPC_ERR_LIMIT;
    }
    if (sp == 0 || world % sp != 0) {
        sp_errf(err, errlen, "sp %u does not divide the world of %u ranks", sp, world);
        return SPC_ERR_INVALID_ARG;
    }
    if (heads == 0) {
        sp_errf(err, errlen, "heads must be positive");
        return SPC_ERR_INVALID_ARG;
    }
    if (heads > MAX_HEADS) {
        sp_errf(err, errlen, "%u heads is more than %u", heads, MAX_HEADS);
        return SPC_ERR_INVALID_ARG;
    }
    if (heads % kv != 0) {
        sp_errf(err, errlen, "%u kv_heads do not divide %u heads", kv, heads);
        return SPC_ERR_INVALID_ARG;
    }
    if ((u != 0 && sp % u != 0) || (ring != 0 && sp % ring != 0)) {
        sp_errf(err, errlen, "ulysses %u and ring %u must divide sp %u", u, ring, sp);
        return SPC_ERR_INVALID_ARG;
    }
    if (u != 0 && ring != 0 && (uint64_t)u * ring != sp) {
        sp_errf(err, errlen, "ulysses %u x ring %u is not sp %u", u, ring, sp);
        return SPC_ERR_INVALID_ARG;
    }
    if (u == 0 && ring != 0)
        u = sp / ring;
    if (u != 0 && kv < u && u % kv != 0) {
        sp_errf(err, errlen, "ulysses %u cannot replicate %u kv heads evenly (use a ulysses degree that %u divides "
             "or that divides %u)", u, kv, kv, kv);
        return SPC_ERR_INVALID_ARG;
    }
    if (u > heads) {
        sp_errf(err, errlen, "ulysses %u exceeds the %u heads: some ranks would hold only dummy heads", u, heads);
        return SPC_ERR_INVALID_ARG;
    }

    p = calloc(1, sizeof *p);
    keys = malloc((size_t)world * sizeof *keys);
    orders = topo != NULL ? calloc(topo->nnodes ? topo->nnodes : 1, sizeof *orders) : NULL;
    if (p == NULL || keys == NULL || (topo != NULL && orders == NULL))
        goto no_memory;
    p->order = malloc((size_t)world * sizeof *p->order);
    p->slot = malloc((size_t)world * sizeof *p->slot);
    p->node = malloc((size_t)world * sizeof *p->node);
    p->domain = malloc((size_t)world * sizeof *p->domain);
    if (!p->order || !p->slot || !p->node || !p->domain)
        goto no_memory;
    p->world = world;
    p->sp = sp;
    p->dp = world / sp;
    p->heads = heads;
    p->kv_heads = kv;

    if ((st = rank_keys(topo, locs, world, keys, orders, err, errlen)) != SPC_OK)
        goto fail;
    qsort(keys, world, sizeof *keys, key_cmp);
    for (uint32_t i = 0; i < world; i++) {
        p->order[i] = keys[i].rank;
        p->slot[keys[i].rank] = i;
        p->node[i] = keys[i].node;
        p->domain[i] = keys[i].domain;
    }

    if (u == 0) {
        int best = choose_ulysses(p, kv, &why);
        if (best < 0)
            goto no_memory;
        u = p->cand[best].ulysses;
        p->chosen = true;
    } else {
        why = spec->ulysses == 0 ? "sp / ring" : "as asked";
    }
    p->ulysses = u;
    p->ring = sp / u;

    heads_fit_t f;
    tally_t t;
    heads_fit(u, heads, kv, &f);
    tally(p->node, p->domain, world, sp, u, f.lq, f.lkv, &t);
    p->q_local = f.lq;
    p->kv_local = f.lkv;
    p->q_dummies = f.q_dummies;
    p->kv_dummies = f.kv_dummies;
    p->ulysses_spanning = t.spanning;
    p->ring_hops = t.hops;
    p->ring_hops_inter = t.hops_inter;
    explain(p, &f, why);
    if (topo != NULL)
        explain_links(p, topo, keys);
    free(keys);
    free_orders(orders, topo);
    *place_p = p;
    return SPC_OK;

no_memory:
    sp_errf(err, errlen, "out of memory placing %u ranks", world);
    st = SPC_ERR_NO_MEMORY;
fail:
    free(keys);
    free_orders(orders, topo);
    sp_place_free(p);
    return st;
}

/* ---------------------------------------------------------------- groups */

uint32_t sp_place_ngroups(const sp_place_t *p, int kind)
{
    switch (kind) {
    case SP_PLACE_DP:      return p->sp;
    case SP_PLACE_SP:      return p->dp;
    case SP_PLACE_ULYSSES: return p->dp * p->ring;
    default:               return p->dp * p->ulysses;
    }
}

uint32_t sp_place_group(const sp_place_t *p, int kind, uint32_t index, uint32_t *ranks)
{
    uint32_t sp = p->sp, u = p->ulysses, n = 0;
    switch (kind) {
    case SP_PLACE_DP:
        for (uint32_t d = 0; d < p->dp; d++)
            ranks[n++] = p->order[d * sp + index];
        break;
    case SP_PLACE_SP:
        for (uint32_t s = 0; s < sp; s++)
            ranks[n++] = p->order[index * sp + s];
        break;
    case SP_PLACE_ULYSSES: {
        uint32_t d = index / p->ring, k = index % p->ring;
        for (uint32_t j = 0; j < u; j++)
            ranks[n++] = p->order[d * sp + k * u + j];
        break;
    }
    default: {
        uint32_t d = index / u, j = index % u;
        for (uint32_t k = 0; k < p->ring; k++)
            ranks[n++] = p->order[d * sp + k * u + j];
        break;
    }
    }
    return n;
}

void sp_place_coords(const sp_place_t *p, uint32_t rank, uint32_t coords[SP_PLACE_KINDS],
                     uint32_t index[SP_PLACE_KINDS])
{
    uint32_t i = p->slot[rank], d = i / p->sp, s = i % p->sp, k = s / p->ulysses, j = s % p->ulysses;
    coords[SP_PLACE_DP] = d;
    coords[SP_PLACE_SP] = s;
    coords[SP_PLACE_ULYSSES] = j;
    coords[SP_PLACE_RING] = k;
    if (index != NULL) {
        index[SP_PLACE_DP] = s;
        index[SP_PLACE_SP] = d;
        index[SP_PLACE_ULYSSES] = d * p->ring + k;
        index[SP_PLACE_RING] = d * p->ulysses + j;
    }
}

/* ---------------------------------------------------------------- bytes */

static bool mul(uint64_t *acc, uint64_t v)
{
    return !__builtin_mul_overflow(*acc, v, acc);
}

spc_status_t sp_place_traffic(const sp_place_t *p, const sp_place_dims_t *d, sp_place_traffic_t *out, char *err,
                              size_t errlen)
{
    sp_place_traffic_t r = { .unit_bytes = 1 };
    bool ok = true;
    if (d != NULL) {
        if (d->batch == 0 || d->seq == 0 || d->hidden == 0 || d->layers == 0 || d->dtype_bytes == 0) {
            sp_errf(err, errlen, "batch, seq, hidden, layers and the dtype size must be positive");
            return SPC_ERR_INVALID_ARG;
        }
        if (d->hidden % p->heads != 0) {
            sp_errf(err, errlen, "hidden %llu is not a multiple of the %u heads", (unsigned long long)d->hidden,
                 p->heads);
            return SPC_ERR_INVALID_ARG;
        }
        r.unit_bytes = d->batch;
        ok = mul(&r.unit_bytes, (d->seq + p->sp - 1) / p->sp) && mul(&r.unit_bytes, d->hidden / p->heads) &&
             mul(&r.unit_bytes, d->dtype_bytes) && mul(&r.unit_bytes, d->layers);
    }
    tally_t t;
    tally(p->node, p->domain, p->world, p->sp, p->ulysses, p->q_local, p->kv_local, &t);

    for (int l = 0; l < SP_LINKS && ok; l++) {
        r.ulysses[l] = t.ul[l];
        r.ring[l] = t.ring[l];
        r.rank_max[l] = t.rank_max[l];
        ok = mul(&r.ulysses[l], r.unit_bytes) && mul(&r.ring[l], r.unit_bytes) && mul(&r.rank_max[l], r.unit_bytes) &&
             !__builtin_add_overflow(r.ulysses[l], r.ring[l], &r.total[l]);
    }
    if (!ok) {
        sp_errf(err, errlen, "the traffic exceeds 2^64 bytes");
        return SPC_ERR_INVALID_ARG;
    }
    *out = r;
    return SPC_OK;
}
