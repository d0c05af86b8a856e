/* Host reduction kernels against a plain reference written here. */
#include <math.h>

#include "sp_kern.h"
#include "sp_test.h"

static double ref(double a, double b, unsigned op)
{
    if (isnan(a) || isnan(b))
        return op == SP_KERN_SUM ? a + b : (isnan(a) ? a : b);
    switch (op) {
    case SP_KERN_SUM: return a + b;
    case SP_KERN_MAX: return a > b ? a : b;
    default:          return a < b ? a : b;
    }
}

int main(void)
{
    enum { N = 1000 };
    srand(7);
    for (unsigned op = SP_KERN_SUM; op <= SP_KERN_MIN; op++) {
        float af[N], bf[N], ef[N];
        double ad[N], bd[N], ed[N];
        for (int i = 0; i < N; i++) {
            af[i] = (float)(rand() % 2001 - 1000) / 7.0f;
            bf[i] = (float)(rand() % 2001 - 1000) / 3.0f;
            ad[i] = (double)(rand() % 2001 - 1000) / 7.0;
            bd[i] = (double)(rand() % 2001 - 1000) / 3.0;
        }
        af[3] = NAN;
        bd[5] = NAN;
        for (int i = 0; i < N; i++) {
            ef[i] = (float)ref(af[i], bf[i], op);
            ed[i] = ref(ad[i], bd[i], op);
        }
        if (op == SP_KERN_SUM)   /* fp32 sums must round in fp32, as the kernel does */
            for (int i = 0; i < N; i++)
                ef[i] = af[i] + bf[i];
        CHECK_EQ(sp_kern_reduce(af, bf, N, SP_KERN_F32, op), 0);
        CHECK_EQ(sp_kern_reduce(ad, bd, N, SP_KERN_F64, op), 0);
        for (int i = 0; i < N; i++) {
            if (isnan(ef[i]))
                CHECK(isnan(af[i]));
            else
                CHECK(memcmp(&af[i], &ef[i], sizeof af[i]) == 0);
            if (isnan(ed[i]))
                CHECK(isnan(ad[i]));
            else
                CHECK(memcmp(&ad[i], &ed[i], sizeof ad[i]) == 0);
        }
    }
    int32_t x = 1;
    CHECK_EQ(sp_kern_reduce(&x, &x, 1, SP_KERN_I32, SP_KERN_SUM), -1);
    CHECK_EQ(sp_kern_reduce(&x, &x, 1, SP_KERN_F32, 9), -1);
    printf("kern: ok\n");
    return 0;
}
