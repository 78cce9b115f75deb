// Op test for patch 0008: GGML_OP_MOE_GATE (the adaptive top-k mask of MoE routing).
//
// Reads cases from a binary file written by tests/test_gating_native.py, runs the op on every
// backend device the library has (CPU, and CUDA when built with it), both forms of the op (masked ids,
// masked weights) with the ids as a strided view of an argsort-like buffer, and writes each target's
// outputs to <out_dir>/<target index>.bin for the test to compare with edgemoe's Python rules.
//
// case record (little endian): int32 rule, int32 logits, float fill, double threshold, double sensitivity,
//                              int32 n_used, int32 n_rows, int32 row_stride (>= n_used, ids storage),
//                              float weights[n_rows][n_used], int32 ids[n_rows][row_stride]
// output per case:             int32 ids[n_rows][n_used], float weights[n_rows][n_used]
// usage: test_moe_gate CASES_FILE OUT_DIR; prints "target <index>: <name>" per target.

#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

namespace {

struct gate_case {
    int32_t rule;
    int32_t logits;
    float   fill;
    double  threshold;
    double  sensitivity;
    int32_t n_used;
    int32_t n_rows;
    int32_t row_stride;

    std::vector<float>   weights; // [n_rows][n_used]
    std::vector<int32_t> ids;     // [n_rows][row_stride]
};

template <typename T>
bool read_val(FILE * f, T & v) {
    return fread(&v, sizeof(T), 1, f) == 1;
}

bool read_cases(const char * path, std::vector<gate_case> & cases) {
    FILE * f = fopen(path, "rb");
    if (!f) {
        return false;
    }
    gate_case c;
    while (read_val(f, c.rule)) {
        bool ok = read_val(f, c.logits) && read_val(f, c.fill) && read_val(f, c.threshold) &&
                  read_val(f, c.sensitivity) && read_val(f, c.n_used) && read_val(f, c.n_rows) &&
                  read_val(f, c.row_stride);
        if (!ok || c.n_used <= 0 || c.n_rows < 0 || c.row_stride < c.n_used) {
            fclose(f);
            return false;
        }
        c.weights.resize((size_t) c.n_rows * c.n_used);
        c.ids.resize((size_t) c.n_rows * c.row_stride);
        ok = fread(c.weights.data(), sizeof(float), c.weights.size(), f) == c.weights.size() &&
             fread(c.ids.data(), sizeof(int32_t), c.ids.size(), f) == c.ids.size();
        if (!ok) {
            fclose(f);
            return false;
        }
        cases.push_back(c);
    }
    fclose(f);
    return true;
}

// runs both forms of the op on backend; ids_out [n_rows][n_used], w_out likewise
bool run_case(ggml_backend_t backend, const gate_case & c, std::vector<int32_t> & ids_out, std::vector<float> & w_out) {
    ggml_init_params params = { 16*ggml_tensor_overhead() + ggml_graph_overhead(), nullptr, true };
    ggml_context * ctx = ggml_init(params);

    ggml_tensor * w    = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, c.n_used, c.n_rows);
    ggml_tensor * span = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, c.row_stride, c.n_rows);
    ggml_tensor * ids  = ggml_view_2d(ctx, span, c.n_used, c.n_rows, span->nb[1], 0);

    const auto rule = (enum ggml_moe_gate_rule) c.rule;
    ggml_tensor * out_ids = ggml_moe_gate(ctx, w, ids,     rule, c.threshold, c.sensitivity, c.logits != 0, 0.0f);
    ggml_tensor * out_w   = ggml_moe_gate(ctx, w, nullptr, rule, c.threshold, c.sensitivity, c.logits != 0, c.fill);

    ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, out_ids);
    ggml_build_forward_expand(gf, out_w);

    bool ok = ggml_backend_supports_op(backend, out_ids) && ggml_backend_supports_op(backend, out_w);
    ggml_backend_buffer_t buf = ok ? ggml_backend_alloc_ctx_tensors(ctx, backend) : nullptr;
    if (buf) {
        ggml_backend_tensor_set(w,    c.weights.data(), 0, ggml_nbytes(w));
        ggml_backend_tensor_set(span, c.ids.data(),     0, ggml_nbytes(span));
        ok = ggml_backend_graph_compute(backend, gf) == GGML_STATUS_SUCCESS;
        if (ok) {
            ids_out.resize((size_t) c.n_rows * c.n_used);
            w_out.resize((size_t) c.n_rows * c.n_used);
            ggml_backend_tensor_get(out_ids, ids_out.data(), 0, ggml_nbytes(out_ids));
            ggml_backend_tensor_get(out_w,   w_out.data(),   0, ggml_nbytes(out_w));
        }
        ggml_backend_buffer_free(buf);
    } else {
        ok = false;
    }
    ggml_free(ctx);
    return ok;
}

} // namespace

int main(int argc, char ** argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s CASES_FILE OUT_DIR\n", argv[0]);
        return 2;
    }
    std::vector<gate_case> cases;
    if (!read_cases(argv[1], cases)) {
        fprintf(stderr, "could not read the cases in %s\n", argv[1]);
        return 2;
    }

    int n_targets = 0;
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        ggml_backend_dev_t dev = ggml_backend_dev_get(i);
        if (ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_ACCEL) {
            continue;
        }
        ggml_backend_t backend = ggml_backend_dev_init(dev, nullptr);
        if (!backend) {
            continue;
        }
        const std::string path = std::string(argv[2]) + "/" + std::to_string(n_targets) + ".bin";
        FILE * f = fopen(path.c_str(), "wb");
        if (!f) {
            fprintf(stderr, "could not write %s\n", path.c_str());
            return 2;
        }
        bool ok = true;
        std::vector<int32_t> ids;
        std::vector<float>   w;
        for (const gate_case & c : cases) {
            if (!run_case(backend, c, ids, w)) {
                ok = false;
                break;
            }
            fwrite(ids.data(), sizeof(int32_t), ids.size(), f);
            fwrite(w.data(),   sizeof(float),   w.size(),   f);
        }
        fclose(f);
        ggml_backend_free(backend);
        if (!ok) {
            printf("FAIL %s: the op is not supported or did not run\n", ggml_backend_dev_name(dev));
            return 1;
        }
        printf("target %d: %s\n", n_targets, ggml_backend_dev_name(dev));
        n_targets++;
    }
    printf("summary: %zu cases, %d targets\n", cases.size(), n_targets);
    return n_targets > 0 ? 0 : 1;
}
