// Op tests, in the style of llama.cpp's test-backend-ops, for patch 0003:
// GGML_OP_MUL_MAT_ID and GGML_OP_ADD_ID with skipped slots (id < 0).
//
// For every backend device (CPU, the CPU repack buffer when the type repacks,
// CUDA when built with it) and every case:
//   - skipped rows of mul_mat_id are exactly 0, skipped rows of add_id are a's rows;
//   - the other rows equal the same op run with one extra expert appended and the
//     skipped slots routed to it, so that every other expert sees the same rows
//     (bitwise on CPU, NMSE vs CPU elsewhere);
//   - guard tensors allocated around the outputs are untouched.
// Prints one line per case and "summary: <cases> cases, <failed> failed"; exit code 1 on failure.

#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace {

constexpr float GUARD = -1234.5f;
constexpr int64_t N_GUARD = 1024;

struct mmid_case {
    ggml_type type;
    int64_t   n_as;    // experts
    int64_t   n_used;  // slots per token
    int64_t   k;       // ne00
    int64_t   m;       // ne01 (rows per expert)
    int64_t   n_tok;   // tokens
    float     p_skip;  // probability that a slot is skipped (1 = all)

    std::string name() const {
        char buf[160];
        snprintf(buf, sizeof(buf), "type=%s n_as=%lld n_used=%lld k=%lld m=%lld n_tok=%lld p_skip=%.2f",
            ggml_type_name(type), (long long) n_as, (long long) n_used, (long long) k, (long long) m,
            (long long) n_tok, p_skip);
        return buf;
    }
};

struct op_result {
    std::vector<float> mm;    // [n_tok][n_used][m]
    std::vector<float> add;   // same shape, add_id(mm, bias, ids)
    bool guards_ok = true;
};

struct inputs {
    std::vector<uint8_t> as;      // quantized experts [n_as]
    std::vector<uint8_t> as_ref;  // the same plus one extra expert [n_as + 1]
    std::vector<float>   b;       // [n_tok][k]
    std::vector<float>   bias;    // [n_as][m]
    std::vector<int32_t> ids;     // [n_tok][n_as] argsort-like storage, first n_used used
    std::vector<int32_t> filled;  // same, skipped slots routed to the extra expert n_as
};

inputs make_inputs(const mmid_case & c, std::mt19937 & rng) {
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    inputs in;

    std::vector<float> w((c.n_as + 1) * c.m * c.k);
    for (auto & x : w) x = u(rng);
    in.as_ref.resize(ggml_row_size(c.type, c.k) * c.m * (c.n_as + 1));
    ggml_quantize_chunk(c.type, w.data(), in.as_ref.data(), 0, c.m * (c.n_as + 1), c.k, nullptr);
    in.as.assign(in.as_ref.begin(), in.as_ref.begin() + ggml_row_size(c.type, c.k) * c.m * c.n_as);

    in.b.resize(c.n_tok * c.k);
    for (auto & x : in.b) x = u(rng);
    in.bias.resize((c.n_as + 1) * c.m);
    for (auto & x : in.bias) x = u(rng);

    std::uniform_real_distribution<float> p(0.0f, 1.0f);
    in.ids.resize(c.n_tok * c.n_as);
    in.filled.resize(c.n_tok * c.n_as);
    for (int64_t t = 0; t < c.n_tok; ++t) {
        std::vector<int32_t> perm(c.n_as);
        for (int64_t e = 0; e < c.n_as; ++e) perm[e] = (int32_t) e;
        std::shuffle(perm.begin(), perm.end(), rng);
        for (int64_t e = 0; e < c.n_as; ++e) {
            const bool skip = e < c.n_used && (c.p_skip >= 1.0f || p(rng) < c.p_skip);
            in.ids[t*c.n_as + e]    = skip ? -1 : perm[e];
            in.filled[t*c.n_as + e] = skip ? (int32_t) c.n_as : perm[e];
        }
    }
    return in;
}

// runs mul_mat_id + add_id once on `backend`, the experts in `w_buft`; ref: the n_as + 1 experts and filled ids
op_result run_op(const mmid_case & c, const inputs & in, bool ref, ggml_backend_t backend, ggml_backend_buffer_type_t w_buft) {
    const int64_t n_as = ref ? c.n_as + 1 : c.n_as;
    const std::vector<uint8_t> & as_data = ref ? in.as_ref : in.as;
    const std::vector<int32_t> & ids     = ref ? in.filled : in.ids;

    ggml_init_params params = { 64*ggml_tensor_overhead() + ggml_graph_overhead(), nullptr, true };

    ggml_context * ctx_w = ggml_init(params);
    ggml_tensor * as = ggml_new_tensor_3d(ctx_w, c.type, c.k, c.m, n_as);
    ggml_backend_buffer_t buf_w = ggml_backend_alloc_ctx_tensors_from_buft(ctx_w, w_buft);

    ggml_context * ctx = ggml_init(params);
    ggml_tensor * b        = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, c.k, 1, c.n_tok);
    ggml_tensor * bias     = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, c.m, n_as);
    ggml_tensor * ids_full = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, c.n_as, c.n_tok);
    // the top-k view of an argsort, as llama.cpp's build_moe_ffn makes it
    ggml_tensor * ids_view = ggml_view_2d(ctx, ids_full, c.n_used, c.n_tok, ids_full->nb[1], 0);
    ggml_tensor * guard0   = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, N_GUARD);
    ggml_tensor * mm       = ggml_mul_mat_id(ctx, as, b, ids_view);
    ggml_tensor * guard1   = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, N_GUARD);
    ggml_tensor * add      = ggml_add_id(ctx, mm, bias, ids_view);
    ggml_tensor * guard2   = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, N_GUARD);
    ggml_set_output(mm);
    ggml_set_output(add);

    ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, add);

    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(ctx, backend);

    ggml_backend_tensor_set(as, as_data.data(), 0, as_data.size());
    ggml_backend_tensor_set(b, in.b.data(), 0, in.b.size()*sizeof(float));
    ggml_backend_tensor_set(bias, in.bias.data(), 0, ggml_nbytes(bias));
    ggml_backend_tensor_set(ids_full, ids.data(), 0, ids.size()*sizeof(int32_t));

    // outputs start as NaN so that a row the op forgets to write is caught
    std::vector<float> nan_fill(ggml_nelements(mm), NAN);
    ggml_backend_tensor_set(mm,  nan_fill.data(), 0, ggml_nbytes(mm));
    ggml_backend_tensor_set(add, nan_fill.data(), 0, ggml_nbytes(add));
    std::vector<float> guard(N_GUARD, GUARD);
    for (ggml_tensor * g : { guard0, guard1, guard2 }) {
        ggml_backend_tensor_set(g, guard.data(), 0, ggml_nbytes(g));
    }

    GGML_ASSERT(ggml_backend_graph_compute(backend, gf) == GGML_STATUS_SUCCESS);

    op_result r;
    r.mm.resize(ggml_nelements(mm));
    r.add.resize(ggml_nelements(add));
    ggml_backend_tensor_get(mm,  r.mm.data(),  0, ggml_nbytes(mm));
    ggml_backend_tensor_get(add, r.add.data(), 0, ggml_nbytes(add));
    for (ggml_tensor * g : { guard0, guard1, guard2 }) {
        std::vector<float> got(N_GUARD);
        ggml_backend_tensor_get(g, got.data(), 0, ggml_nbytes(g));
        for (float x : got) {
            r.guards_ok = r.guards_ok && x == GUARD;
        }
    }

    ggml_backend_buffer_free(buf);
    ggml_backend_buffer_free(buf_w);
    ggml_free(ctx);
    ggml_free(ctx_w);
    return r;
}

bool supported(const mmid_case & c, ggml_backend_t backend, ggml_backend_buffer_type_t w_buft) {
    // a throwaway graph node to ask the backend
    ggml_init_params params = { 16*ggml_tensor_overhead(), nullptr, true };
    ggml_context * ctx_w = ggml_init(params);
    ggml_tensor * as  = ggml_new_tensor_3d(ctx_w, c.type, c.k, c.m, c.n_as);
    ggml_backend_buffer_t buf_w = ggml_backend_alloc_ctx_tensors_from_buft(ctx_w, w_buft);
    ggml_context * ctx = ggml_init(params);
    ggml_tensor * b   = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, c.k, 1, c.n_tok);
    ggml_tensor * ids = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, c.n_used, c.n_tok);
    ggml_tensor * mm  = ggml_mul_mat_id(ctx, as, b, ids);
    const bool ok = buf_w && ggml_backend_supports_op(backend, mm);
    ggml_backend_buffer_free(buf_w);
    ggml_free(ctx);
    ggml_free(ctx_w);
    return ok;
}

double nmse(const float * a, const float * ref, int64_t n) {
    double err = 0.0, norm = 0.0;
    for (int64_t i = 0; i < n; ++i) {
        err  += (a[i] - ref[i]) * (double) (a[i] - ref[i]);
        norm += ref[i] * (double) ref[i];
    }
    return norm > 0.0 ? err / norm : err;
}

// checks `got` (skipped ids) against `ref` (filled ids, no skips); returns an empty string when fine
std::string check(const mmid_case & c, const inputs & in, const op_result & got, const op_result & ref,
                  const op_result * cpu, bool exact) {
    if (!got.guards_ok) {
        return "guard tensors overwritten";
    }
    for (int64_t t = 0; t < c.n_tok; ++t) {
        for (int64_t s = 0; s < c.n_used; ++s) {
            const int32_t id  = in.ids[t*c.n_as + s];
            const int64_t off = (t*c.n_used + s)*c.m;
            for (int64_t i = 0; i < c.m; ++i) {
                const float mm = got.mm[off + i], add = got.add[off + i];
                if (id < 0) {
                    if (mm != 0.0f || std::signbit(mm)) {
                        return "skipped row of mul_mat_id is not 0 (token " + std::to_string(t) + ", slot " + std::to_string(s) + ")";
                    }
                    if (add != 0.0f) {
                        return "skipped row of add_id is not a's row (token " + std::to_string(t) + ", slot " + std::to_string(s) + ")";
                    }
                } else if (exact && (mm != ref.mm[off + i] || add != ref.add[off + i])) {
                    return "kept row differs from the unskipped op (token " + std::to_string(t) + ", slot " + std::to_string(s) + ")";
                }
            }
        }
    }
    if (!exact) {
        // kept rows vs the CPU backend's result of the same op
        std::vector<float> a, r;
        for (int64_t t = 0; t < c.n_tok; ++t) {
            for (int64_t s = 0; s < c.n_used; ++s) {
                if (in.ids[t*c.n_as + s] < 0) continue;
                const int64_t off = (t*c.n_used + s)*c.m;
                a.insert(a.end(), got.add.begin() + off, got.add.begin() + off + c.m);
                r.insert(r.end(), cpu->add.begin() + off, cpu->add.begin() + off + c.m);
            }
        }
        const double e = nmse(a.data(), r.data(), (int64_t) a.size());
        if (!(e <= 5e-4)) {
            return "kept rows NMSE vs CPU " + std::to_string(e) + " > 5e-4";
        }
    }
    return "";
}

} // namespace

int main(int argc, char ** argv) {
    const int n_threads = argc > 1 ? atoi(argv[1]) : 2;

    std::vector<mmid_case> cases;
    for (ggml_type type : { GGML_TYPE_F32, GGML_TYPE_F16, GGML_TYPE_Q4_0, GGML_TYPE_Q8_0, GGML_TYPE_Q4_K, GGML_TYPE_Q6_K }) {
        for (int64_t n_tok : { 1, 5, 33, 96 }) {
            for (float p_skip : { 0.0f, 0.4f, 1.0f }) {
                cases.push_back({ type, 8, 4, 256, 64, n_tok, p_skip });
            }
        }
    }
    cases.push_back({ GGML_TYPE_Q4_K, 32, 8, 512, 96, 7, 0.5f });  // more experts than slots by far
    cases.push_back({ GGML_TYPE_F32, 4, 1, 64, 16, 3, 0.5f });     // top-1

    // the CPU backend's result for each case, used as the reference of the other backends
    ggml_backend_dev_t cpu_dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    ggml_backend_t cpu = ggml_backend_dev_init(cpu_dev, nullptr);
    ggml_backend_cpu_set_n_threads(cpu, n_threads);

    struct target {
        std::string                name;
        ggml_backend_t             backend;
        ggml_backend_buffer_type_t w_buft;
        bool                       exact;
    };
    std::vector<target> targets;
    targets.push_back({ "CPU", cpu, ggml_backend_dev_buffer_type(cpu_dev), true });

    auto get_extra = (ggml_backend_dev_get_extra_bufts_t)
        ggml_backend_reg_get_proc_address(ggml_backend_dev_backend_reg(cpu_dev), "ggml_backend_dev_get_extra_bufts");
    if (get_extra) {
        for (ggml_backend_buffer_type_t * p = get_extra(cpu_dev); p && *p; ++p) {
            targets.push_back({ std::string("CPU+") + ggml_backend_buft_name(*p), cpu, *p, true });
        }
    }
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        ggml_backend_dev_t dev = ggml_backend_dev_get(i);
        if (ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_CPU) continue;
        ggml_backend_t be = ggml_backend_dev_init(dev, nullptr);
        if (be) {
            targets.push_back({ ggml_backend_dev_name(dev), be, ggml_backend_dev_buffer_type(dev), false });
        }
    }

    for (const target & tg : targets) {
        printf("target: %s\n", tg.name.c_str());
    }

    std::mt19937 rng(42);
    int n_run = 0, n_failed = 0;
    for (const mmid_case & c : cases) {
        const inputs in = make_inputs(c, rng);
        const op_result cpu_ref = run_op(c, in, true, cpu, ggml_backend_dev_buffer_type(cpu_dev));
        for (const target & tg : targets) {
            if (!supported(c, tg.backend, tg.w_buft)) {
                continue;
            }
            const op_result ref = run_op(c, in, true,  tg.backend, tg.w_buft);
            const op_result got = run_op(c, in, false, tg.backend, tg.w_buft);
            const std::string err = check(c, in, got, ref, &cpu_ref, tg.exact);
            n_run++;
            n_failed += !err.empty();
            printf("%s %s [%s]%s%s\n", err.empty() ? "OK  " : "FAIL", tg.name.c_str(), c.name().c_str(),
                err.empty() ? "" : ": ", err.c_str());
        }
    }
    printf("summary: %d cases, %d failed\n", n_run, n_failed);

    for (const target & tg : targets) {
        if (tg.backend != cpu) ggml_backend_free(tg.backend);
    }
    ggml_backend_free(cpu);
    return n_failed == 0 && n_run > 0 ? 0 : 1;
}
