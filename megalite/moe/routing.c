/* The MoE router's top-k choice on the host (megalite/moe/native_routing.py builds and loads
   it; megalite/moe/router.py's topk_routing states the rule). scores [tokens, experts] fp32,
   row-major, plus bias [experts] (or NULL): each token's `topk` experts in descending order of
   score + bias, ties to the lower index and NaN above everything (torch's stable descending
   sort); with groups > 1, experts outside the token's `group_topk` best groups (group score:
   the sum of its two largest entries, or its one entry; ties to the lower group) count as
   -inf. order [tokens, topk] int64. One pass over a token's scores instead of a sort. */
#include <math.h>
#include <stdint.h>

static inline int above(float a, float b) { return (isnan(a) && !isnan(b)) || a > b; }

/* Offers (value, index) to the best `count` <= k so far (values descending); returns the new
   count. It goes after those it does not beat: offered in index order, equal values stay in
   index order. */
static inline int64_t offer(float *values, int64_t *indices, int64_t count, int64_t k,
                            float value, int64_t index) {
    int64_t j = count;
    if (j == k) {
        if (!above(value, values[k - 1])) return count;
        j = k - 1;
    } else {
        count++;
    }
    for (; j > 0 && above(value, values[j - 1]); j--) {
        values[j] = values[j - 1];
        indices[j] = indices[j - 1];
    }
    values[j] = value;
    indices[j] = index;
    return count;
}

void route(const float *scores, const float *bias, int64_t tokens, int64_t experts,
           int64_t groups, int64_t group_topk, int64_t topk, int64_t *order) {
    int64_t size = experts / groups, kept[groups], chosen[topk];
    float choice[experts], best[topk > group_topk ? topk : group_topk];
    unsigned char allowed[groups];
    for (int64_t t = 0; t < tokens; t++) {
        const float *row = scores + t * experts;
        for (int64_t e = 0; e < experts; e++) choice[e] = bias ? row[e] + bias[e] : row[e];
        for (int64_t g = 0; g < groups; g++) allowed[g] = groups == 1;
        if (groups > 1) {
            int64_t count = 0;
            for (int64_t g = 0; g < groups; g++) {
                const float *member = choice + g * size;
                float first = member[0], second = -INFINITY;
                for (int64_t i = 1; i < size; i++) {
                    if (above(member[i], first)) {
                        second = first;
                        first = member[i];
                    } else if (above(member[i], second)) {
                        second = member[i];
                    }
                }
                count = offer(best, kept, count, group_topk, size > 1 ? first + second : first,
                              g);
            }
            for (int64_t j = 0; j < group_topk; j++) allowed[kept[j]] = 1;
        }
        int64_t count = 0;
        for (int64_t g = 0, e = 0; g < groups; g++)
            for (int64_t i = 0; i < size; i++, e++)
                count = offer(best, chosen, count, topk, allowed[g] ? choice[e] : -INFINITY, e);
        for (int64_t j = 0; j < topk; j++) order[t * topk + j] = chosen[j];
    }
}
