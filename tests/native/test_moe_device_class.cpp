// llm_moe_buft_is_device (src/llama-moe-graph.h of the patched tree): whether a buffer of a device other than the
// CPU is the device's (its backend computes on it) or the CPU's (a host buffer the backend does not compute on, as
// CUDA_Host's pinned memory for the layers past -ngl). argv[1]: HOST:PORT of an RPC server, whose device stands
// in for a GPU: its own buffer type is the device's, the CPU's buffer type seen from it is the CPU's.
#include "llama-moe-graph.h"

#include "ggml-backend.h"

#include <cstdio>

static int n_fail = 0;

static void expect(bool got, bool want, const char * what) {
    printf("%s %s: %s\n", got == want ? "OK  " : "FAIL", what, got ? "device" : "cpu");
    n_fail += got != want;
}

int main(int argc, char ** argv) {
    // the truth table: (host buffer, the backend computes on it)
    expect(llm_moe_buft_is_device(false, true),  true,  "device buffer");
    expect(llm_moe_buft_is_device(true,  true),  true,  "host buffer a device computes on (integrated)");
    expect(llm_moe_buft_is_device(true,  false), false, "host buffer a device does not compute on (CUDA_Host)");
    expect(llm_moe_buft_is_device(false, false), true,  "device buffer of another backend");

    if (argc > 1) {
        ggml_backend_reg_t rpc = ggml_backend_reg_by_name("RPC");
        typedef ggml_backend_reg_t (*add_server_t)(const char * endpoint);
        add_server_t add_server = rpc ? (add_server_t) ggml_backend_reg_get_proc_address(rpc, "ggml_backend_rpc_add_server") : nullptr;
        ggml_backend_reg_t reg = add_server ? add_server(argv[1]) : nullptr;
        if (reg == nullptr || ggml_backend_reg_dev_count(reg) < 1) {
            printf("FAIL no RPC device at %s\n", argv[1]);
            return 1;
        }
        ggml_backend_dev_t dev = ggml_backend_reg_dev_get(reg, 0);
        ggml_backend_buffer_type_t own = ggml_backend_dev_buffer_type(dev);
        ggml_backend_buffer_type_t cpu = ggml_backend_dev_buffer_type(ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU));
        expect(llm_moe_buft_is_device(ggml_backend_buft_is_host(own), ggml_backend_dev_supports_buft(dev, own)), true, "rpc buffer");
        expect(llm_moe_buft_is_device(ggml_backend_buft_is_host(cpu), ggml_backend_dev_supports_buft(dev, cpu)), false, "cpu buffer on rpc");
    }
    printf("summary: %d failed\n", n_fail);
    return n_fail == 0 ? 0 : 1;
}
