"""Compile the Triton kernels ahead of time for a Hopper GPU (sm_90) without one present.

Run as a script with TRITON_INTERPRET unset (test_attention_triton_compiles.py does). The
interpreter cannot catch what only the compiler checks (loop-carried types, dot shapes and
layouts, register allocation by ptxas); this does, for the configurations the launchers pick.
Exit status 77 means this triton has no NVIDIA backend.
"""

import sys

import triton

try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError:
    sys.exit(77)

from batchtop.kernels import attention_triton

POINTER = {"float32": "*fp32", "bfloat16": "*bf16", "float16": "*fp16"}
INT_POINTERS = {"query_start_loc_ptr", "seq_lens_ptr", "block_table_ptr", "slot_mapping_ptr"}
FLOATS = {"qk_scale"}


def compile_kernel(kernel, constexprs: dict, dtype: str, num_warps: int = 4):
    names = kernel.arg_names
    signature = {}
    for name in names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in INT_POINTERS:
            signature[name] = "*i32"
        elif name.endswith("_ptr"):
            signature[name] = POINTER[dtype]
        else:
            signature[name] = "fp32" if name in FLOATS else "i32"
    source = ASTSource(kernel, signature, constexprs={(names.index(k),): v for k, v in constexprs.items()})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})


def main() -> None:
    assert not attention_triton.INTERPRET, "run with TRITON_INTERPRET unset"
    # (dtype, block_size, num_q_heads, num_kv_heads, head_dim, max_query_len)
    cases = [
        ("bfloat16", 16, 9, 3, 64, 1),  # SmolLM2 decode
        ("bfloat16", 16, 9, 3, 64, 512),  # SmolLM2 mixed step
        ("bfloat16", 32, 32, 8, 128, 2048),  # Llama-8B-like prefill
        ("float16", 16, 8, 8, 128, 1),  # MHA decode
        ("float32", 16, 4, 1, 96, 7),  # fp32, head_dim not a power of two
    ]
    for dtype, block_size, num_q_heads, num_kv_heads, head_dim, max_query_len in cases:
        config = attention_triton.attention_constexprs(
            block_size, num_q_heads, num_kv_heads, head_dim, max_query_len)
        compiled = compile_kernel(attention_triton._paged_attention_kernel, config, dtype)
        assert "cubin" in compiled.asm, "ptxas did not run"
        print("attention ok", dtype, config)
        config = attention_triton.write_kv_cache_constexprs(block_size, num_kv_heads, head_dim)
        compile_kernel(attention_triton._write_kv_cache_kernel, config, dtype)
        print("write ok", dtype, config)


if __name__ == "__main__":
    main()
